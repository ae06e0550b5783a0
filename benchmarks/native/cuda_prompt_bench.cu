// The CUDA backend's expert passes (gate_up, down, combine through kernels.h's launchers, as the
// backend calls them: bf16 takes the tensor-core kernels) over buffers that
// benchmarks/cuda_prompt.py allocates with torch and hands over by address (ctypes), so that the
// script times them with the same CUDA events as torch's grouped matmuls on the same data.
// Built as a shared library against csrc/cuda/kernels (or another commit's copy: the launchers
// of kernels.h are the interface):
//   nvcc -std=c++20 -O3 -arch=sm_90 -shared -Xcompiler -fPIC -I<dir above kernels> -Icsrc/engine \
//     -o libprompt.so benchmarks/native/cuda_prompt_bench.cu <kernels>/experts.cu \
//     [<kernels>/mma_experts.cu [-DSTRATA_CUDA_MMA_ONE_PIECE_BENCH]] [wgmma.o]
// where a tree has wgmma_experts.cu, wgmma.o is it built apart for sm_90a (tests/cuda/device_run.sh:
// wgmma_object); -DSTRATA_PB_BF16_WGMMA=1 runs the bf16 passes on that family instead, =2 as the
// backend's default does (wgmma for prompt waves, mma.sync for decode).
// (pb_reserve allocates the scratch a tree's kernels take, as the backend's bind does.)
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/kernels.h"
#if __has_include("kernels/mma_experts.h")
#include "kernels/mma_experts.h"
#endif

using namespace strata::cuda;

#ifndef STRATA_PB_BF16_WGMMA
#define STRATA_PB_BF16_WGMMA 0
#endif

namespace {
DevLayout layout;
DevBuffers buffers;
}  // namespace

extern "C" {

// The geometry (bf16 weights by default: format 2), the arena of n_slots records (device
// memory; each record gate [inter, hidden], up [inter, hidden], down [hidden, inter] at the byte
// offsets given) and the scratch: x [rows, hidden] float32, weights [rows * top_k], h
// [rows * top_k, inter], y [rows * top_k, hidden], out [rows, hidden].
int pb_configure(std::uint32_t n_experts, std::uint32_t hidden, std::uint32_t inter,
                 std::uint32_t top_k, std::uint32_t format, const void* arena,
                 std::uint64_t slot_bytes, std::uint32_t n_slots, std::uint64_t off_gate,
                 std::uint64_t off_up, std::uint64_t off_down, float* x, float* weights, float* h,
                 float* y, float* out) {
  DevLayout L;
  L.n_experts = n_experts, L.top_k = top_k, L.hidden = hidden, L.inter = inter;
  L.format = format;
#if STRATA_PB_BF16_WGMMA
  L.bf16_wgmma = STRATA_PB_BF16_WGMMA;  // trees with the wgmma family alone; 2: auto's rule
#endif
  const std::uint64_t offs[3] = {off_gate, off_up, off_down};
  for (int m = 0; m < 3; ++m) {
    L.m[m].weight = offs[m];
    L.m[m].rows = m == 2 ? hidden : inter;
    L.m[m].cols = m == 2 ? inter : hidden;
  }
  DevBuffers b;
  b.arena = static_cast<const unsigned char*>(arena);
  b.slot_bytes = slot_bytes, b.n_slots = n_slots;
  b.x = x, b.weights = weights, b.h = h, b.y = y, b.out = out;
  layout = L;
  buffers = b;
  return int(prepare_kernels(L));
}

// The kernels' device scratch for up to max_rows tokens, where the tree's kernels have one (the
// tensor-core kernels' bf16 pieces of x and h: STRATA_CUDA_MMA_PIECES); after pb_configure.
// Returns the allocation's error.
int pb_reserve(std::uint32_t max_rows) {
#ifdef STRATA_CUDA_MMA_PIECES
  void* x = nullptr;
  void* h = nullptr;
  cudaError_t e = cudaMalloc(&x, mma_x_pieces_bytes(layout, max_rows) + 16);
  if (e == cudaSuccess) e = cudaMalloc(&h, mma_h_pieces_bytes(layout, max_rows) + 16);
  if (e != cudaSuccess) return int(e);
  buffers.x_pieces = static_cast<std::uint16_t*>(x);
  buffers.h_pieces = static_cast<std::uint16_t*>(h);
#ifdef STRATA_CUDA_MMA_X_REST
  void* rest = nullptr;
  const std::size_t rest_bytes = (max_rows + 2) * sizeof(std::uint32_t);
  if (cudaError_t r = cudaMalloc(&rest, rest_bytes); r != cudaSuccess) return int(r);
  if (cudaError_t r = cudaMemset(rest, 0, rest_bytes); r != cudaSuccess) return int(r);
  buffers.x_rest = static_cast<std::uint32_t*>(rest);
#endif
#else
  (void)max_rows;
#endif
  return 0;
}

// One layer's expert work for `rows` tokens over a group table in device memory (uint32:
// [0] the group count, then group_slot, group_start, group_count, each n_experts long, then the
// entries), on `stream`: bit 1 gate_up, bit 2 down, bit 4 combine. Returns the launch error.
int pb_launch(std::uint32_t rows, std::uint32_t* groups, void* stream, int passes) {
  DevBuffers b = buffers;
  const std::uint32_t E = layout.n_experts;
  b.groups_n = groups, b.group_slot = groups + 1, b.group_start = groups + 1 + E;
  b.group_count = groups + 1 + 2 * E, b.group_entries = groups + 1 + 3 * E;
  auto s = static_cast<cudaStream_t>(stream);
  cudaError_t e = cudaSuccess;
  if ((passes & 1) && e == cudaSuccess) e = launch_gate_up(layout, b, rows, s);
  if ((passes & 2) && e == cudaSuccess) e = launch_down(layout, b, rows, s);
  if ((passes & 4) && e == cudaSuccess) e = launch_combine(layout, b, rows, s);
  return int(e);
}

}  // extern "C"
