// What both bf16 tensor-core families (mma_experts.cu's mma.sync, wgmma_experts.cu's wgmma) share
// around their kernels: a prompt's x split into its bf16 pieces once a pass, into
// DevBuffers::x_pieces in the one layout both stage from ([rows][3][K]), and whether a pass's
// rows can be staged 16 bytes at a time. In an unnamed namespace: each family's translation unit
// gets its own copy, built for its own architecture (sm_90 and PTX, or sm_90a).
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>

#include "device_types.h"
#include "mma.cuh"

namespace strata::cuda {
namespace {

// x's rows -> their bf16 pieces, [rows][3][K] (K a multiple of 4, x 16-byte aligned): the same
// split3 as every block's own split, once a pass.
__global__ void split_rows_kernel(const float* __restrict__ x, std::uint16_t* __restrict__ out,
                                  std::uint32_t rows, std::uint32_t K) {
  const std::uint32_t quads = K / 4;
  const std::uint64_t n = std::uint64_t(rows) * quads;
  for (std::uint64_t q = blockIdx.x * std::uint64_t(blockDim.x) + threadIdx.x; q < n;
       q += std::uint64_t(gridDim.x) * blockDim.x) {
    const std::uint64_t r = q / quads, c = q % quads * 4;
    const float4 v = *reinterpret_cast<const float4*>(x + r * K + c);
    const float xs[4] = {v.x, v.y, v.z, v.w};
    std::uint16_t p[3][4];
#pragma unroll
    for (int j = 0; j < 4; ++j) split3(xs[j], p[0][j], p[1][j], p[2][j]);
#pragma unroll
    for (int piece = 0; piece < 3; ++piece)
      *reinterpret_cast<uint2*>(out + (r * 3 + piece) * K + c) =
          uint2{std::uint32_t(p[piece][0]) | std::uint32_t(p[piece][1]) << 16,
                std::uint32_t(p[piece][2]) | std::uint32_t(p[piece][3]) << 16};
  }
}

// b.x's first `rows` rows into b.x_pieces, on s (before a prompt's gate_up).
cudaError_t split_x(const DevLayout& L, const DevBuffers& b, std::uint32_t rows, cudaStream_t s) {
  const std::uint64_t quads = std::uint64_t(rows) * L.hidden / 4;
  const unsigned blocks = unsigned(std::min<std::uint64_t>((quads + 255) / 256, 4096));
  split_rows_kernel<<<blocks, 256, 0, s>>>(b.x, b.x_pieces, rows, L.hidden);
  return cudaGetLastError();
}

bool aligned16(std::uint64_t v) { return (v & 15u) == 0; }

// Every staged 16-byte piece aligned and whole: the row length a multiple of 8 columns, the
// arena, slot stride and weight offsets, and the activations' base.
bool vectorizable(const DevLayout& L, const DevBuffers& b, bool gate_up) {
  const std::uint32_t cols = gate_up ? L.hidden : L.inter;
  const auto act = reinterpret_cast<std::uintptr_t>(gate_up ? b.x : b.h);
  const std::uint64_t w = gate_up ? L.m[0].weight | L.m[1].weight : L.m[2].weight;
  return cols % 8 == 0 && aligned16(reinterpret_cast<std::uintptr_t>(b.arena)) &&
         aligned16(b.slot_bytes) && aligned16(w) && aligned16(act);
}

// Whether a prompt pass stages its activations' pieces from the scratch: the family's pieces on
// (`enabled`, its compile-time knob), from `min_rows` rows (below them its decode kernels run),
// with the scratch bound and the pass vectorizable. gate_up writes h's pieces exactly when down
// will stage them (the same rows, the same buffers).
bool stages_pieces(const DevLayout& L, const DevBuffers& b, std::uint32_t rows, bool gate_up,
                   bool enabled, std::uint32_t min_rows) {
  return enabled && rows >= min_rows && (gate_up ? b.x_pieces : b.h_pieces) != nullptr &&
         vectorizable(L, b, gate_up);
}

// A pass that stages pieces: gate_up splits x first (down's h pieces are gate_up's output),
// then the family's kernel (launch()).
template <bool GateUp, class Launch>
cudaError_t launch_with_pieces(const DevLayout& L, const DevBuffers& b, std::uint32_t rows,
                               cudaStream_t s, Launch&& launch) {
  if constexpr (GateUp) {
    if (const cudaError_t e = split_x(L, b, rows, s); e != cudaSuccess) return e;
  }
  return launch();
}

}  // namespace
}  // namespace strata::cuda
