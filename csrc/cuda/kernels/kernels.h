// Launches of the CUDA expert and routing kernels, in stream order. Each returns the launch's
// error (cudaSuccess when queued). The arithmetic: every output element is one float32 dot
// product in one fixed order (dot.cuh), whichever pass, wave or grouping computes it, so the
// output is the same bits at every arena size and split mode (I11 on CUDA).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "device_types.h"

namespace strata::cuda {

// ids, weights <- top-k routing of `rows` tokens by router[layer] (weights null: prediction).
cudaError_t launch_route(const DevLayout& L, const DevBuffers& b, std::uint32_t layer,
                         std::uint32_t rows, std::int32_t* ids, float* weights, cudaStream_t s);
// plan <- the smap snapshot of every routed entry.
cudaError_t launch_plan(const DevLayout& L, const DevBuffers& b, std::uint32_t layer,
                        std::uint32_t rows, cudaStream_t s);
// Groups the selected entries by expert and resolves each expert's slot (the plan's snapshot
// for Resident, smap now for Missing and Wave); an unpublished one sets the error word and the
// pass computes nothing.
cudaError_t launch_group(const DevLayout& L, const DevBuffers& b, std::uint32_t layer,
                         std::uint32_t rows, Select select, cudaStream_t s);
// h <- act(gate x + bg, up x + bu) for the grouped entries.
cudaError_t launch_gate_up(const DevLayout& L, const DevBuffers& b, std::uint32_t rows,
                           cudaStream_t s);
// y <- w * (down h + bd) for the grouped entries.
cudaError_t launch_down(const DevLayout& L, const DevBuffers& b, std::uint32_t rows,
                        cudaStream_t s);
// out[t] <- sum_j y[t, j], in j order.
cudaError_t launch_combine(const DevLayout& L, const DevBuffers& b, std::uint32_t rows,
                           cudaStream_t s);
// Raises the kernels' dynamic shared-memory limit for this geometry (once per backend).
cudaError_t prepare_kernels(const DevLayout& L);

}  // namespace strata::cuda
