// Launches of the bf16 expert kernels on Hopper's wgmma (wgmma_experts.cu, built for
// sm_90a alone): the same contract as mma_experts.h's, over the same group table and the same
// pieces scratch (mma_x_pieces_bytes, mma_h_pieces_bytes). experts.cu dispatches a layout's bf16
// passes by DevLayout::bf16_wgmma (host/bf16_families.h) and the pass's rows.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "device_types.h"

namespace strata::cuda {

// In the default family (STRATA_CUDA_BF16=auto, host/bf16_families.h), bf16 passes of this many
// rows and more take wgmma, fewer mma.sync (whose decode is the faster). A compile-time knob.
#ifndef STRATA_CUDA_WGMMA_FROM_ROWS
#define STRATA_CUDA_WGMMA_FROM_ROWS 8
#endif
constexpr std::uint32_t kWgmmaFromRows = STRATA_CUDA_WGMMA_FROM_ROWS;

// Why this process cannot run the wgmma kernels on device 0 (not compute capability 9.0, or no
// sm_90a code for it), or "" when it can.
std::string wgmma_unavailable();

// h <- act(gate x + bg, up x + bu) for the grouped entries (L.format must be bf16).
cudaError_t launch_gate_up_wgmma(const DevLayout& L, const DevBuffers& b, std::uint32_t rows,
                                 cudaStream_t s);
// y <- w * (down h + bd) for the grouped entries (L.format must be bf16).
cudaError_t launch_down_wgmma(const DevLayout& L, const DevBuffers& b, std::uint32_t rows,
                              cudaStream_t s);

}  // namespace strata::cuda
