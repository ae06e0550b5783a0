// Scratch: the device-visible working buffers of MoE layer calls (inputs, routed ids and weights,
// predictions, router logits, plan, expert activations and outputs), sized for a number of rows
// and wrapped into the DeviceBuffers a backend binds. Grows to the largest chunk seen, never past
// max_rows, and is kept until release(): memory stays bounded by one chunk (I12). bind() keeps
// the backend holding the current buffers.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>

#include "common/check.h"

#include "exec/backend.h"
#include "residency/expert_stream.h"

namespace strata {

// One scratch buffer, its elements left unset. A prompt's scratch is allocated at each turn's
// first chunk (and freed at its end, unless BUF_REUSE keeps it), and writing zeros into all of
// it cost more than the layer's kernels (benchmarks/prompt_scratch.py and
// benchmarks/cuda_window_rows.py measure it), where the cuda backend's calls on device memory
// never touch the host's x, out, h and y at all. Unset, a page nobody writes is never faulted
// in. Every element is written before it is read; checked builds (kChecked: Debug,
// STRATA_CHECKS) fill the buffer with a poison instead, NaN floats and out-of-range integers, so
// that a read before a write shows in the parity tests.
template <class T>
class ScratchArray {
  static_assert(std::is_trivially_copyable_v<T>);

 public:
  void allocate(std::size_t n) {
    p_ = std::make_unique_for_overwrite<T[]>(n);
    if constexpr (kChecked)  // all-ones floats are NaN; 0xA5A5A5A5 is a negative int32
      std::memset(static_cast<void*>(p_.get()), std::is_floating_point_v<T> ? 0xFF : 0xA5,
                  n * sizeof(T));
  }
  void reset() { p_.reset(); }
  T* data() { return p_.get(); }
  T& operator[](std::size_t i) { return p_[i]; }

 private:
  std::unique_ptr<T[]> p_;
};

class Scratch {
 public:
  Scratch(const ExpertStream& stream, const float* routers);

  // Makes room for `rows`; returns true when the buffers moved (the backend must rebind).
  bool ensure(std::uint32_t rows);
  // Makes room for `rows` and has `backend` hold the buffers: after they moved, or after a bind
  // that threw (a Device error naming the backend; the next call binds again). The backend is
  // synchronized first whenever the buffers change: nothing may run over them.
  void bind(std::uint32_t rows, Backend& backend);
  void release();  // frees everything; the next ensure() or bind() reallocates
  // release() once no command of `backend` may still read the buffers.
  void release(Backend& backend);
  const DeviceBuffers& buffers() const { return b_; }
  std::uint32_t rows() const { return rows_; }
  std::uint64_t bytes() const { return bytes_.load(std::memory_order_relaxed); }  // any thread

 private:
  const ExpertStream& stream_;
  const PackLayout& L_;
  DeviceBuffers b_;
  std::uint32_t rows_ = 0;
  std::atomic<std::uint64_t> bytes_{0};  // written by the owner, read by any thread
  bool bound_ = false;  // the backend holds the current buffers
  ScratchArray<float> x_, weights_, logits_, h_, y_, out_, moce_moved_;
  ScratchArray<std::int32_t> ids_, pred_ids_[2], wave_;
  ScratchArray<std::uint32_t> plan_, wave_n_, moce_changed_, route_resident_;
};

}  // namespace strata
