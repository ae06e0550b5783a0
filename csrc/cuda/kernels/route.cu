// Routing on the device: router logits (one warp per expert, the fixed dot order of dot.cuh),
// then the pack's rule on one thread per token (top-k by logit, ties to the lower index; the
// softmax sums in expert order), as cpu_kernels.cpp's route computes it. One launch runs a
// layer's route and its predictions (blockIdx.y picks the task): the same x, other routers.
#include <mutex>

#include "dot.cuh"
#include "kernels.h"

namespace strata::cuda {
namespace {

// 32 warps: a decode token is one block, whose latency is the layer's first wait.
constexpr std::uint32_t kRouteThreads = 1024;
constexpr std::uint32_t kMaxTopK = 64;

// Block (token t, task y). x's row and the task's logits live in shared memory; x comes from
// the pinned staging the device thread filled (x_staged, mapped) or from device x. With x_staged
// the route task's blocks also store the row into device x, for the expert passes behind it.
__global__ void route_kernel(DevLayout L, DevBuffers b, RouteTasks tasks, const float* x_staged) {
  extern __shared__ float smem[];
  const std::uint32_t t = blockIdx.x;
  const RouteTask task = tasks.t[blockIdx.y];
  const std::uint32_t E = L.n_experts, H = L.hidden, k = L.top_k;
  const std::uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float* x = smem;          // [H]
  float* logit = smem + H;  // [E]
  const float* src = (x_staged ? x_staged : b.x) + std::size_t(t) * H;
#pragma unroll 4
  for (std::uint32_t c = threadIdx.x; c < H; c += kRouteThreads) {
    const float v = src[c];
    x[c] = v;
    if (x_staged && blockIdx.y == 0) b.x[std::size_t(t) * H + c] = v;
  }
  __syncthreads();
  const float* router = b.routers + std::size_t(task.layer) * E * H;
  for (std::uint32_t e = warp; e < E; e += kRouteThreads / 32) {
    const float d = warp_sum(lane_dot(router + std::size_t(e) * H, x, H, lane));
    if (lane == 0) logit[e] = d;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  std::uint32_t order[kMaxTopK];
  for (std::uint32_t j = 0; j < k; ++j) {
    std::uint32_t best = kAbsentSlot;
    for (std::uint32_t e = 0; e < E; ++e) {
      bool taken = false;
      for (std::uint32_t q = 0; q < j; ++q) taken = taken || order[q] == e;
      if (taken) continue;
      if (best == kAbsentSlot || logit[e] > logit[best]) best = e;  // ties keep the lower index
    }
    order[j] = best;
    if (task.ids) task.ids[std::size_t(t) * k + j] = std::int32_t(best);
    if (task.ids_back) task.ids_back[std::size_t(t) * k + j] = std::int32_t(best);
  }
  if (!task.weights) return;
  float w[kMaxTopK];
  const float top = logit[order[0]];
  if (L.routing == 0) {  // softmax over every expert, then the chosen (renormalised if asked)
    float total = 0;
    for (std::uint32_t e = 0; e < E; ++e) total += expf(logit[e] - top);
    float chosen = 0;
    for (std::uint32_t j = 0; j < k; ++j) {
      w[j] = expf(logit[order[j]] - top) / total;
      chosen += w[j];
    }
    if (L.norm_topk)
      for (std::uint32_t j = 0; j < k; ++j) w[j] /= chosen;
  } else {  // softmax over the chosen logits only
    float total = 0;
    for (std::uint32_t j = 0; j < k; ++j) total += expf(logit[order[j]] - top);
    for (std::uint32_t j = 0; j < k; ++j) w[j] = expf(logit[order[j]] - top) / total;
  }
  if ((L.plant & kPlantRoute) && k > 1) w[1] *= 1.0f + 1.0f / 1024.0f;
  for (std::uint32_t j = 0; j < k; ++j) {
    task.weights[std::size_t(t) * k + j] = w[j];
    if (task.weights_back) task.weights_back[std::size_t(t) * k + j] = w[j];
  }
}

std::size_t route_smem(const DevLayout& L) { return (std::size_t(L.hidden) + L.n_experts) * 4; }

}  // namespace

cudaError_t prepare_route(const DevLayout& L) {
  // The limit is the kernel's, process-wide, and backends of other geometries share it: raised
  // to the largest asked for, never lowered (48 KiB needs no raise).
  static std::mutex mu;
  static std::size_t raised = 48 * 1024;
  std::lock_guard<std::mutex> lk(mu);
  if (route_smem(L) <= raised) return cudaSuccess;
  const cudaError_t e = cudaFuncSetAttribute(
      route_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(route_smem(L)));
  if (e == cudaSuccess) raised = route_smem(L);
  return e;
}

cudaError_t launch_route(const DevLayout& L, const DevBuffers& b, std::uint32_t rows,
                         const RouteTasks& tasks, const float* x_staged, cudaStream_t s) {
  if (rows == 0 || tasks.n == 0) return cudaSuccess;
  if (L.top_k > kMaxTopK || tasks.n > kMaxRouteTasks) return cudaErrorInvalidValue;
  route_kernel<<<dim3(rows, tasks.n), kRouteThreads, route_smem(L), s>>>(L, b, tasks, x_staged);
  return cudaGetLastError();
}

}  // namespace strata::cuda
