// A vector copied by a block's threads (device memory to shared memory, typically), with several
// 16-byte loads of a thread in flight before their stores. A plain copy loop keeps each store
// behind its own load, so a thread waits one memory round trip per 16 bytes it copies: four for
// a router's x of 2048 floats over 128 threads, paid before any product can start.
#pragma once

#include <cstdint>

namespace strata::cuda {

// dst[0, n) = src[0, n) (and also[0, n) where given), by the block's threads; n a multiple of 4,
// every pointer 16-byte aligned. kAhead: loads a thread issues before its first store.
template <int kAhead = 4>
__device__ __forceinline__ void stage_floats(float* dst, const float* src, std::uint32_t n,
                                             float* also = nullptr) {
  const std::uint32_t step = 4 * blockDim.x;
  for (std::uint32_t c0 = 4 * threadIdx.x; c0 < n; c0 += step * kAhead) {
    float4 v[kAhead];
#pragma unroll
    for (int a = 0; a < kAhead; ++a)
      if (c0 + step * a < n) v[a] = *reinterpret_cast<const float4*>(src + c0 + step * a);
#pragma unroll
    for (int a = 0; a < kAhead; ++a)
      if (c0 + step * a < n) {
        *reinterpret_cast<float4*>(dst + c0 + step * a) = v[a];
        if (also) *reinterpret_cast<float4*>(also + c0 + step * a) = v[a];
      }
  }
}

}  // namespace strata::cuda
