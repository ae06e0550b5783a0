// Routing on the device: router logits (one warp per expert, the fixed dot order of dot.cuh),
// then the pack's rule on one thread per token (top-k by logit, ties to the lower index; the
// softmax sums in expert order), as cpu_kernels.cpp's route computes it.
#include "dot.cuh"
#include "kernels.h"

namespace strata::cuda {
namespace {

constexpr std::uint32_t kRouteThreads = 256;
constexpr std::uint32_t kMaxTopK = 64;

__global__ void route_kernel(DevLayout L, DevBuffers b, std::uint32_t layer, std::int32_t* ids,
                             float* weights) {
  const std::uint32_t t = blockIdx.x;
  const std::uint32_t E = L.n_experts, H = L.hidden, k = L.top_k;
  const std::uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const float* router = b.routers + std::size_t(layer) * E * H;
  const float* x = b.x + std::size_t(t) * H;
  float* logit = b.logits + std::size_t(t) * E;
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
    ids[std::size_t(t) * k + j] = std::int32_t(best);
  }
  if (!weights) return;
  float* w = weights + std::size_t(t) * k;
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
}

}  // namespace

cudaError_t launch_route(const DevLayout& L, const DevBuffers& b, std::uint32_t layer,
                         std::uint32_t rows, std::int32_t* ids, float* weights, cudaStream_t s) {
  if (rows == 0) return cudaSuccess;
  if (L.top_k > kMaxTopK) return cudaErrorInvalidValue;
  route_kernel<<<rows, kRouteThreads, 0, s>>>(L, b, layer, ids, weights);
  return cudaGetLastError();
}

}  // namespace strata::cuda
