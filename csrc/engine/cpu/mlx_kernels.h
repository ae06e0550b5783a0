// The expert passes in MLX's arithmetic (Arithmetic::MlxBfloat16 / MlxFloat32): the same
// entries and slots as the Float32 passes in cpu_kernels.cpp, each output element computed in
// MLX's operation order and roundings (mlx_arithmetic.h), so it is bitwise what mlx-lm's
// SwitchGLU computes on the CPU. Like every kernel here, an element's value depends only on its
// inputs: the streamed output stays bitwise the all-resident one (I11).
#pragma once

#include <cstdint>
#include <vector>

#include "exec/backend.h"
#include "pack/weights.h"

namespace strata::cpu::mlx {

// Empty when the layout can run in `a`; else why not (the Window's check names it).
// Why the CPU backend cannot reproduce MLX's arithmetic `a` for the pack's format class
// `format_class` (-1: for every class), "" when it can.
const char* unsupported(const PackLayout& L, Arithmetic a, std::int32_t format_class = -1);

// h[i] for rows [r0, r1) of the intermediate, for every entry i of `entries` (token i / top_k).
void gate_up_rows(const DeviceBuffers& b, const ExpertView& ev,
                  const std::vector<std::uint32_t>& entries, std::uint32_t r0, std::uint32_t r1,
                  Rounding rounding);
// y[i] = weight_i * (down h_i) for rows [r0, r1) of the output.
void down_rows(const DeviceBuffers& b, const ExpertView& ev,
               const std::vector<std::uint32_t>& entries, std::uint32_t r0, std::uint32_t r1,
               Rounding rounding);

}  // namespace strata::cpu::mlx
