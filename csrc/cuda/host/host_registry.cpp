#include "host_registry.h"

#include <cuda_runtime_api.h>

#include <map>
#include <mutex>

namespace strata::cuda {
namespace {

struct Range {
  std::size_t bytes;
  unsigned refs;
  void* device;
};

std::mutex& registry_mu() {
  static std::mutex mu;
  return mu;
}
std::map<const void*, Range>& registry() {  // registry_mu()
  static std::map<const void*, Range> r;
  return r;
}

}  // namespace

void* map_host(const void* p, std::size_t bytes, std::string* why) {
  std::lock_guard<std::mutex> lk(registry_mu());
  auto& r = registry();
  auto it = r.find(p);
  if (it != r.end()) {
    if (it->second.bytes < bytes) {
      *why = "host range registered with a smaller size";
      return nullptr;
    }
    ++it->second.refs;
    return it->second.device;
  }
  void* hp = const_cast<void*>(p);
  cudaError_t e = cudaHostRegister(hp, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable);
  if (e != cudaSuccess) {
    *why = std::string("cudaHostRegister: ") + cudaGetErrorString(e);
    cudaGetLastError();
    return nullptr;
  }
  void* dp = nullptr;
  e = cudaHostGetDevicePointer(&dp, hp, 0);
  if (e != cudaSuccess) {
    *why = std::string("cudaHostGetDevicePointer: ") + cudaGetErrorString(e);
    cudaHostUnregister(hp);
    cudaGetLastError();
    return nullptr;
  }
  r.emplace(p, Range{bytes, 1, dp});
  return dp;
}

void unmap_host(const void* p) {
  std::lock_guard<std::mutex> lk(registry_mu());
  auto& r = registry();
  auto it = r.find(p);
  if (it == r.end()) return;
  if (--it->second.refs > 0) return;
  cudaHostUnregister(const_cast<void*>(p));
  cudaGetLastError();  // an arena already unmapped by its stream: nothing left to undo
  r.erase(it);
}

}  // namespace strata::cuda
