// The one float32 dot-product order of the CUDA backend. A warp computes a dot of length n:
// lane l takes the 8-column chunks l, l + 32, l + 64, ... and accumulates each chunk's products
// in column order with fused multiply-adds; the 32 lane sums are folded by a fixed xor
// butterfly (every lane ends with the same bits, a + b being commutative). The order depends on
// n alone, never on the grid, the grouping or which pass runs, which is what makes the output
// bitwise independent of arena size and split mode.
#pragma once

#include <cstdint>

namespace strata::cuda {

constexpr unsigned kFullMask = 0xFFFFFFFFu;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(kFullMask, v, off);
  return v;
}

// Lane l's share of dot(w, x) over chunks of 8, w and x float arrays of length n.
__device__ __forceinline__ float lane_dot(const float* w, const float* x, std::uint32_t n,
                                          std::uint32_t lane) {
  float acc = 0.0f;
  for (std::uint32_t c0 = 8 * lane; c0 < n; c0 += 8 * 32) {
    const std::uint32_t end = c0 + 8 < n ? c0 + 8 : n;
    for (std::uint32_t c = c0; c < end; ++c) acc = __fmaf_rn(w[c], x[c], acc);
  }
  return acc;
}

}  // namespace strata::cuda
