// Launches of the tensor-core expert kernels (mma_experts.cu), which take every pass of the bf16
// weight format at every row count (experts.cu dispatches to them): the same contract as
// launch_gate_up and launch_down in kernels.h, over the same group table.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "device_types.h"

namespace strata::cuda {

// The bf16 pieces scratch (DevBuffers::x_pieces, ::h_pieces) for `rows` tokens, in bytes: 0 for
// a format other than bf16. The backend allocates it at bind; without it the kernels split in
// shared memory (the same bits).
std::size_t mma_x_pieces_bytes(const DevLayout& L, std::uint32_t rows);
std::size_t mma_h_pieces_bytes(const DevLayout& L, std::uint32_t rows);
// Benchmarks built against trees with and without the scratch test for it, and for the word
// saying whether x's values are all bf16 (DevBuffers::x_rest).
#define STRATA_CUDA_MMA_PIECES 1
#define STRATA_CUDA_MMA_X_REST 1

// h <- act(gate x + bg, up x + bu) for the grouped entries (L.format must be bf16).
cudaError_t launch_gate_up_mma(const DevLayout& L, const DevBuffers& b, std::uint32_t rows,
                               cudaStream_t s);
// y <- w * (down h + bd) for the grouped entries (L.format must be bf16).
cudaError_t launch_down_mma(const DevLayout& L, const DevBuffers& b, std::uint32_t rows,
                            cudaStream_t s);

}  // namespace strata::cuda
