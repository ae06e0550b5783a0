// The CPU reference kernels. Plain C++; each output element is computed by one fixed sequence of
// float operations whatever the thread count, chunking or pass split, which is what makes the
// streamed output bitwise identical to the all-resident run (I11).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "exec/backend.h"
#include "pack/weights.h"

namespace strata::cpu {

// Splits [0, n) into contiguous chunks run on the backend's workers; blocks until all are done.
using ParallelFor = std::function<void(std::uint32_t n, const std::function<void(std::uint32_t,
                                                                               std::uint32_t)>&)>;

// Fixed-order dot product: eight lane accumulators (vectorisable without -ffast-math), folded
// in a fixed tree.
float dot(const float* a, const float* b, std::uint32_t n);

// out[(r - r0) * n_x + e] = dot(row r of m, xs[e], m.cols) for r in [r0, r1), bit for bit, at
// memory speed: rows are dequantized a few at a time into `tile` (SIMD table lookups and
// widenings) and each tile row is dotted with every input while it is in cache. Every
// (row, input) keeps dot's own lanes and fold, so the result depends on nothing but its inputs.
void matrix_dots(const MatrixView& m, std::uint32_t r0, std::uint32_t r1, const float* const* xs,
                 std::uint32_t n_x, float* out, std::vector<float>& tile);

// Top-k routing of `rows` tokens into ids (and weights, when not null). With moce on it reads
// layer's residency from smap once, adjusts each token's selection (moce.h) and writes the
// per-token moce figures and that residency to their buffers.
void route(const DeviceBuffers& b, std::uint32_t layer, std::uint32_t rows, std::int32_t* ids,
           float* weights, const ParallelFor& pf, const MoceParams& moce = {});
void plan(const DeviceBuffers& b, std::uint32_t layer, std::uint32_t rows);
// Returns false when an entry of the pass has no published slot (an invariant violation).
// `rounding`: Float32 here, the Mlx modes in mlx_kernels.cpp.
bool gate_up(const DeviceBuffers& b, std::uint32_t layer, std::uint32_t rows, Pass pass,
             const ParallelFor& pf, Rounding rounding = {});
bool down(const DeviceBuffers& b, std::uint32_t layer, std::uint32_t rows, Pass pass,
          const ParallelFor& pf, Rounding rounding = {});
bool moe_mm(const DeviceBuffers& b, std::uint32_t layer, std::uint32_t rows, const ParallelFor& pf,
            Rounding rounding = {});
void combine(const DeviceBuffers& b, std::uint32_t rows, const ParallelFor& pf);

}  // namespace strata::cpu
