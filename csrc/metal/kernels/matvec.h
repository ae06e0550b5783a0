// The decode mat-vec core, built the way MLX's qmv_fast is: a threadgroup is two simdgroups of
// 32 lanes, each simdgroup owns kRowsPerSimd consecutive output rows; a lane walks its blocks of
// 16 columns (stride 32 * 16), loads x for a block once into registers and reuses it for every
// row (and every matrix sharing x: gate and up), then each row is reduced with one simd_sum.
// No threadgroup memory. Lanes past K simply contribute zero, so K needs no particular multiple.
#pragma once

#include "formats.h"

// res[n * kRowsPerSimd + r] = row (row0 + r) of matrix n, dotted with x[0, K). Rows at or past
// n_rows give 0. Must be called by all 32 lanes of the simdgroup (uniform control flow).
template <class Fmt, uint N>
inline void dot_rows(thread const MatrixRef* m, uint row0, uint n_rows, device const float* x,
                     uint K, uint lane, thread float* res) {
  float acc[N * kRowsPerSimd];
  for (uint i = 0; i < N * kRowsPerSimd; ++i) acc[i] = 0.0f;
  for (uint k0 = lane * kBlock; k0 < K; k0 += kSimdWidth * kBlock) {
    float xr[kBlock];
    const float xsum = Fmt::prepare_x(x, k0, K, xr);
    for (uint r = 0; r < kRowsPerSimd; ++r) {
      if (row0 + r >= n_rows) break;
      for (uint n = 0; n < N; ++n)
        acc[n * kRowsPerSimd + r] += Fmt::block_dot(m[n], row0 + r, k0, K, xr, xsum);
    }
  }
  for (uint i = 0; i < N * kRowsPerSimd; ++i) res[i] = simd_sum(acc[i]);
}
