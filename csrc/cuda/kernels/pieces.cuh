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

// Compile-time knob: 0 keeps gate_up on three pieces whatever x holds (and the split writes no
// x_rest), to time what the one-piece path costs a pass that cannot take it (device_run.sh's
// prompt variant xr0).
#ifndef STRATA_CUDA_X_ONE_PIECE
#define STRATA_CUDA_X_ONE_PIECE 1
#endif
constexpr bool kXOnePiece = STRATA_CUDA_X_ONE_PIECE != 0;

// x's rows -> their bf16 pieces, [rows][3][K] (K a multiple of 4, x 16-byte aligned): the same
// split3 as every block's own split, once a pass; a block a row. rest (may be null; x_rest's
// layout, device_types.h): rest[2 + r] is whether row r has a nonzero mid or lo piece, i.e. a
// value that is not a bf16 value, and the last block to finish ORs those into rest[0] (counted
// by rest[1], which it leaves zero again), so the word is written whole every pass: no memset
// before, which cost gate_up more than the split itself.
__global__ void split_rows_kernel(const float* __restrict__ x, std::uint16_t* __restrict__ out,
                                  std::uint32_t rows, std::uint32_t K, std::uint32_t* rest) {
  const std::uint32_t quads = K / 4;
  for (std::uint32_t r = blockIdx.x; r < rows; r += gridDim.x) {  // the same r for the block
    std::uint32_t tail = 0;  // this thread's mid and lo pieces, OR-ed
    for (std::uint32_t q = threadIdx.x; q < quads; q += blockDim.x) {
      const std::uint64_t c = std::uint64_t(q) * 4;
      const float4 v = *reinterpret_cast<const float4*>(x + r * std::uint64_t(K) + c);
      const float xs[4] = {v.x, v.y, v.z, v.w};
      std::uint16_t p[3][4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        split3(xs[j], p[0][j], p[1][j], p[2][j]);
        tail |= std::uint32_t(p[1][j]) | p[2][j];
      }
#pragma unroll
      for (int piece = 0; piece < 3; ++piece)
        *reinterpret_cast<uint2*>(out + (r * 3ull + piece) * K + c) =
            uint2{std::uint32_t(p[piece][0]) | std::uint32_t(p[piece][1]) << 16,
                  std::uint32_t(p[piece][2]) | std::uint32_t(p[piece][3]) << 16};
    }
    if (rest) {
      const bool any = __syncthreads_or(tail != 0);
      if (threadIdx.x == 0) rest[2 + r] = any;
    }
  }
  if (!rest) return;  // uniform: a kernel argument
  __shared__ bool last;
  if (threadIdx.x == 0) {
    __threadfence();  // this block's row words are visible GPU-wide before it counts itself
    last = atomicAdd(rest + 1, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  std::uint32_t any = 0;
  for (std::uint32_t r = threadIdx.x; r < rows; r += blockDim.x) any |= __ldcg(rest + 2 + r);
  if (__syncthreads_or(any != 0)) any = 1;
  if (threadIdx.x == 0) {
    rest[0] = any;
    rest[1] = 0;  // every block of this launch has counted: ready for the next one
  }
}

// b.x's first `rows` rows into b.x_pieces, and b.x_rest, on s (before a prompt's gate_up).
cudaError_t split_x(const DevLayout& L, const DevBuffers& b, std::uint32_t rows, cudaStream_t s) {
  split_rows_kernel<<<std::min(rows, 4096u), 256, 0, s>>>(b.x, b.x_pieces, rows, L.hidden,
                                                          kXOnePiece ? b.x_rest : nullptr);
  return cudaGetLastError();
}

// Whether gate_up may take x's hi pieces alone (pass-wide, from the split's x_rest[0]): with x's
// values all bf16 the mid and lo pieces are +0, so their products add zeros, and the kernels'
// epilogues add +0.0f to every sum (which turns a -0 into +0 and changes nothing else), so the
// one piece gives the three pieces' bits, and a token its bits alone and in any batch. (A
// non-finite weight is the exception: inf * 0 makes the three pieces' sum NaN where the one
// piece's is the infinity, so the output is non-finite either way.)
__device__ __forceinline__ bool x_is_bf16(const DevBuffers& b) {
  return b.x_rest && *b.x_rest == 0;
}

// Whether a family's kernel instance may take that path: gate_up staging the pieces, in the
// family's three-piece arithmetic (not a bench's one-piece build), with the knob on.
template <bool GateUp, bool Pre, int FamilyPieces>
constexpr bool kMayTakeOnePiece = GateUp && Pre && FamilyPieces == 3 && kXOnePiece;

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
