// RAII owners of the cuda backend's memory: device arrays and mapped pinned host arrays. A
// failed allocation throws (cuda_check.h's message), leaving the owner empty.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "cuda_check.h"

namespace strata::cuda {

// Device memory, freed with its owner; grown by ensure(), never shrunk (bind() keeps the
// largest scratch seen: I12 bounds it).
class DeviceArray {
 public:
  DeviceArray() = default;
  explicit DeviceArray(std::size_t bytes, const char* what = "cudaMalloc") { ensure(bytes, what); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  ~DeviceArray() { reset(); }
  void reset() {
    if (p_) cudaFree(p_);
    p_ = nullptr;
    bytes_ = 0;
  }
  // `what` names the allocation in the error ("cudaMalloc (the arena's device mirror)").
  void ensure(std::size_t bytes, const char* what = "cudaMalloc") {
    if (bytes <= bytes_) return;
    reset();
    const cudaError_t e = cudaMalloc(&p_, bytes ? bytes : 4);
    if (e != cudaSuccess) p_ = nullptr;
    cuda_check(e, what);
    bytes_ = bytes;
  }
  template <class T>
  T* as() const {
    return static_cast<T*>(p_);
  }

 private:
  void* p_ = nullptr;
  std::size_t bytes_ = 0;
};

// Pinned host memory, mapped into the GPU (staging the kernels read, readback they write),
// freed with its owner.
class PinnedArray {
 public:
  PinnedArray() = default;
  PinnedArray(const PinnedArray&) = delete;
  PinnedArray& operator=(const PinnedArray&) = delete;
  ~PinnedArray() { reset(); }
  void reset() {
    if (p_) cudaFreeHost(p_);
    p_ = nullptr;
    bytes_ = 0;
  }
  void ensure(std::size_t bytes) {
    if (bytes <= bytes_) return;
    reset();
    cudaError_t e = cudaHostAlloc(&p_, bytes, cudaHostAllocPortable | cudaHostAllocMapped);
    if (e == cudaSuccess) e = cudaHostGetDevicePointer(&d_, p_, 0);
    if (e != cudaSuccess) {
      if (p_) cudaFreeHost(p_);
      p_ = d_ = nullptr;
    }
    cuda_check(e, "cudaHostAlloc (mapped)");
    bytes_ = bytes;
  }
  std::size_t bytes() const { return bytes_; }
  template <class T>
  T* as() const {
    return static_cast<T*>(p_);
  }
  // The same bytes' device address (what a kernel reads or writes).
  template <class T>
  T* device(std::size_t byte_offset = 0) const {
    return reinterpret_cast<T*>(static_cast<unsigned char*>(d_) + byte_offset);
  }

 private:
  void* p_ = nullptr;
  void* d_ = nullptr;
  std::size_t bytes_ = 0;
};

}  // namespace strata::cuda
