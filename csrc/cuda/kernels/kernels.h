// Launches of the CUDA expert and routing kernels, in stream order. Each returns the launch's
// error (cudaSuccess when queued). The arithmetic: every output element is computed in one fixed
// order per weight format (float32 FMAs in dot.cuh's order; bf16 on the tensor cores with exact
// products, mma_experts.cu), whichever pass, wave, grouping or batch computes it, so the output
// is the same bits at every arena size, split mode and batch size (I11 on CUDA).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "device_types.h"

namespace strata::cuda {

// One routing of a fused launch: top-k of router[layer] on x into ids and, when routing rather
// than predicting, the mixture weights; each also into the host's readback copy (pinned, mapped:
// what the host reads at the next Signal, with no copy of its own). A null pointer is skipped.
struct RouteTask {
  std::uint32_t layer = 0;
  std::int32_t* ids = nullptr;
  float* weights = nullptr;  // null: a prediction
  std::int32_t* ids_back = nullptr;
  float* weights_back = nullptr;
};
constexpr std::uint32_t kMaxRouteTasks = 3;  // the route and predictions at distance 1 and 2
struct RouteTasks {
  RouteTask t[kMaxRouteTasks];
  std::uint32_t n = 0;
};

// Every task over `rows` tokens of x, in one launch. x_staged (mapped pinned memory, or null):
// the layer input the device thread staged; the kernel reads it there and stores it into b.x,
// which saves the upload's copy.
cudaError_t launch_route(const DevLayout& L, const DevBuffers& b, std::uint32_t rows,
                         const RouteTasks& tasks, const float* x_staged, cudaStream_t s);
// plan <- the smap snapshot of every routed entry.
cudaError_t launch_plan(const DevLayout& L, const DevBuffers& b, std::uint32_t layer,
                        std::uint32_t rows, cudaStream_t s);
// Groups the selected entries by expert and resolves each expert's slot (the plan's snapshot
// for Resident, smap now for Missing and Wave); an unpublished one sets the error word and the
// pass computes nothing.
cudaError_t launch_group(const DevLayout& L, const DevBuffers& b, std::uint32_t layer,
                         std::uint32_t rows, Select select, cudaStream_t s);
// Whether launch_gate_up and launch_down over `rows` read the groups from
// DevBuffers::host_groups alone (as kernel arguments), never from the device table: where the
// host grouped the pass it then need not upload the table.
bool groups_as_arguments(const DevLayout& L, std::uint32_t rows);
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
cudaError_t prepare_route(const DevLayout& L);
// The route kernel's device scratch for `rows` tokens: DevBuffers::logits (floats) and
// DevBuffers::route_done (counters, zero before the first launch; each launch leaves them zero).
std::size_t route_scratch_floats(const DevLayout& L, std::uint32_t rows);
std::size_t route_counters(std::uint32_t rows);

}  // namespace strata::cuda
