// Routing on the device: router logits (one warp per expert, the fixed 8-column dot order of
// dot.cuh), then the pack's rule (top-k by logit, ties to the lower index; the softmax sums in
// expert order), as cpu_kernels.cpp's route computes it. One launch runs a layer's route and its
// predictions (blockIdx.z picks the task): the same x, other routers.
//
// A token's logits are spread over several blocks (blockIdx.y: kRouteLogits experts each), so a
// decode token's router (n_experts * hidden floats per task) is read by many multiprocessors at
// once rather than by one. Each block writes its logits to device scratch; the last block of a
// (token, task) to finish (an atomic counter per (token, task), reset by that block for the next
// launch) takes the top-k and the weights. A logit is the same dot in the same order whichever
// block computes it, and the selection keeps the sequential scan's result exactly (below), so the
// outputs are the bits one block per token gave.
#include <algorithm>
#include <mutex>

#include "dot.cuh"
#include "kernels.h"

namespace strata::cuda {
namespace {

// Compile-time tuning knobs, set to what was fastest on the H200 (docs/cuda.md: 32, 16 and 8
// experts per block, copy from 1 or 8 rows, measured by benchmarks/native/cuda_kernel_bench.cu).
#ifndef STRATA_CUDA_ROUTE_LOGITS  // experts per block, one per warp
#define STRATA_CUDA_ROUTE_LOGITS 8
#endif
#ifndef STRATA_CUDA_ROUTE_COPY_ROWS  // below: kCopyStagedRows
#define STRATA_CUDA_ROUTE_COPY_ROWS 1
#endif
constexpr std::uint32_t kRouteLogits = STRATA_CUDA_ROUTE_LOGITS;
constexpr std::uint32_t kMaxTopK = 64;

// One logit: lane_dot's order (8-column chunks l, l + 32, ...; each chunk in column order),
// with two 16-byte loads per chunk where the row allows them (hidden a multiple of 8: every row
// then starts 32-byte aligned in the router and in x).
__device__ __forceinline__ float router_dot(const float* w, const float* x, std::uint32_t n,
                                            std::uint32_t lane) {
  if (n % 8 != 0) return warp_sum(lane_dot(w, x, n, lane));
  float acc = 0.0f;
#pragma unroll 8
  for (std::uint32_t c0 = 8 * lane; c0 < n; c0 += 8 * 32) {
    const float4 w0 = *reinterpret_cast<const float4*>(w + c0);
    const float4 w1 = *reinterpret_cast<const float4*>(w + c0 + 4);
    const float4 x0 = *reinterpret_cast<const float4*>(x + c0);
    const float4 x1 = *reinterpret_cast<const float4*>(x + c0 + 4);
    acc = __fmaf_rn(w0.x, x0.x, acc);
    acc = __fmaf_rn(w0.y, x0.y, acc);
    acc = __fmaf_rn(w0.z, x0.z, acc);
    acc = __fmaf_rn(w0.w, x0.w, acc);
    acc = __fmaf_rn(w1.x, x1.x, acc);
    acc = __fmaf_rn(w1.y, x1.y, acc);
    acc = __fmaf_rn(w1.z, x1.z, acc);
    acc = __fmaf_rn(w1.w, x1.w, acc);
  }
  return warp_sum(acc);
}

// The top-k of logit[0, E) into order[0, k): round j takes the largest logit not yet taken, ties
// to the lower index. The sequential scan (`logit[e] > logit[best]`, e ascending) finds, when no
// logit is NaN, the lowest index among the largest: a total order (value down, index up), so a
// warp may split the scan over its lanes (each scanning its experts in ascending order) and fold
// the lanes' winners by that order. With a NaN among the logits the scan's result depends on where
// the NaN sits; one thread then runs the scan itself, as before.
__device__ void select_top_k(const float* logit, std::uint32_t E, std::uint32_t k,
                             std::uint32_t* order, std::uint32_t lane) {
  bool nan = false;
  for (std::uint32_t e = lane; e < E; e += 32) nan = nan || isnan(logit[e]);
  if (__any_sync(kFullMask, nan) || E > 32 * 32) {
    if (lane == 0)
      for (std::uint32_t j = 0; j < k; ++j) {
        std::uint32_t best = kAbsentSlot;
        for (std::uint32_t e = 0; e < E; ++e) {
          bool taken = false;
          for (std::uint32_t q = 0; q < j; ++q) taken = taken || order[q] == e;
          if (taken) continue;
          if (best == kAbsentSlot || logit[e] > logit[best]) best = e;  // ties keep the lower
        }
        order[j] = best;
      }
    __syncwarp();
    return;
  }
  std::uint32_t taken = 0;  // bit m: expert lane + 32 m is chosen
  for (std::uint32_t j = 0; j < k; ++j) {
    std::uint32_t best = kAbsentSlot;
    float bv = 0.0f;
    for (std::uint32_t e = lane, m = 0; e < E; e += 32, ++m) {
      if (taken & (1u << m)) continue;
      const float v = logit[e];
      if (best == kAbsentSlot || v > bv) best = e, bv = v;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const std::uint32_t ob = __shfl_xor_sync(kFullMask, best, off);
      const float ov = __shfl_xor_sync(kFullMask, bv, off);
      if (ob != kAbsentSlot &&
          (best == kAbsentSlot || ov > bv || (ov == bv && ob < best)))
        best = ob, bv = ov;
    }
    if (best != kAbsentSlot && best % 32 == lane) taken |= 1u << (best / 32);
    if (lane == 0) order[j] = best;
  }
  __syncwarp();
}

// Block (token t, expert block, task z). The block's x row lives in shared memory; x comes from
// the pinned staging the device thread filled (x_staged, mapped) or from device x. With x_staged
// the first block of the route task also stores the row into device x, for the passes behind it.
__global__ void route_kernel(DevLayout L, DevBuffers b, RouteTasks tasks, const float* x_staged,
                             std::uint32_t rows) {
  extern __shared__ float smem[];
  const std::uint32_t t = blockIdx.x, z = blockIdx.z;
  const RouteTask task = tasks.t[z];
  const std::uint32_t E = L.n_experts, H = L.hidden, k = L.top_k;
  const std::uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float* x = smem;  // [H], then (the last block) logit [E], ex [E], order [k]
  const float* src = (x_staged ? x_staged : b.x) + std::size_t(t) * H;
  const bool store_x = x_staged && z == 0 && blockIdx.y == 0;
  if (H % 4 == 0) {
    for (std::uint32_t c = 4 * threadIdx.x; c < H; c += 4 * blockDim.x) {
      const float4 v = *reinterpret_cast<const float4*>(src + c);
      *reinterpret_cast<float4*>(x + c) = v;
      if (store_x) *reinterpret_cast<float4*>(b.x + std::size_t(t) * H + c) = v;
    }
  } else {
    for (std::uint32_t c = threadIdx.x; c < H; c += blockDim.x) {
      const float v = src[c];
      x[c] = v;
      if (store_x) b.x[std::size_t(t) * H + c] = v;
    }
  }
  __syncthreads();
  float* logits = b.logits + (std::size_t(z) * rows + t) * E;  // this (token, task)'s scratch
  const float* router = b.routers + std::size_t(task.layer) * E * H;
  const std::uint32_t e = blockIdx.y * kRouteLogits + warp;
  if (e < E) {
    const float d = router_dot(router + std::size_t(e) * H, x, H, lane);
    if (lane == 0) {
      logits[e] = d;
      __threadfence();  // the logit is visible GPU-wide before this block counts itself done
    }
  }
  __syncthreads();
  __shared__ bool last;
  if (threadIdx.x == 0) {
    std::uint32_t* done = b.route_done + std::size_t(z) * rows + t;
    last = atomicAdd(done, 1u) == gridDim.y - 1;
    if (last) *done = 0;  // every block of this launch has counted: ready for the next one
  }
  __syncthreads();
  if (!last || warp != 0) return;
  __threadfence();
  float* logit = x + H;
  float* ex = logit + E;
  std::uint32_t* order = reinterpret_cast<std::uint32_t*>(ex + E);
  for (std::uint32_t q = lane; q < E; q += 32) logit[q] = __ldcg(logits + q);  // from L2
  __syncwarp();
  select_top_k(logit, E, k, order, lane);
  for (std::uint32_t j = lane; j < k; j += 32) {
    if (task.ids) task.ids[std::size_t(t) * k + j] = std::int32_t(order[j]);
    if (task.ids_back) task.ids_back[std::size_t(t) * k + j] = std::int32_t(order[j]);
  }
  if (!task.weights) return;
  const float top = logit[order[0]];
  // Each exp is one correctly placed call whichever lane computes it; the sums run on lane 0 in
  // the sequential order (experts ascending, then j ascending).
  if (L.routing == 0)
    for (std::uint32_t q = lane; q < E; q += 32) ex[q] = expf(logit[q] - top);
  __syncwarp();
  if (lane != 0) return;
  float w[kMaxTopK];
  if (L.routing == 0) {  // softmax over every expert, then the chosen (renormalised if asked)
    float total = 0;
    for (std::uint32_t q = 0; q < E; ++q) total += ex[q];
    float chosen = 0;
    for (std::uint32_t j = 0; j < k; ++j) {
      w[j] = ex[order[j]] / total;
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

// x from the staging into device x, for a batch (below).
__global__ void copy_x_kernel(float* dst, const float* src, std::size_t n) {
  for (std::size_t i = std::size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += std::size_t(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

// From this many rows the staged x is copied into device x first and every block reads it there
// (from L2); below it every block reads its row from the staging over PCIe, which saves a launch
// but costs rows * blocks rows of PCIe reads. On the H200 copying first won even for one decode
// token (16 blocks: 21.7 us against 25.8 with the route and both predictions), hence 1.
constexpr std::uint32_t kCopyStagedRows = STRATA_CUDA_ROUTE_COPY_ROWS;

std::size_t route_smem(const DevLayout& L) {
  return (std::size_t(L.hidden) + 2 * std::size_t(L.n_experts) + L.top_k) * 4;
}

}  // namespace

std::size_t route_scratch_floats(const DevLayout& L, std::uint32_t rows) {
  return std::size_t(kMaxRouteTasks) * rows * L.n_experts;
}

std::size_t route_counters(std::uint32_t rows) { return std::size_t(kMaxRouteTasks) * rows; }

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
  if (L.top_k > kMaxTopK || tasks.n > kMaxRouteTasks || !b.logits || !b.route_done)
    return cudaErrorInvalidValue;
  if (x_staged && rows >= kCopyStagedRows) {
    const std::size_t n = std::size_t(rows) * L.hidden;
    copy_x_kernel<<<unsigned(std::min<std::size_t>((n + 255) / 256, 1024)), 256, 0, s>>>(
        b.x, x_staged, n);
    x_staged = nullptr;
  }
  const std::uint32_t blocks = (L.n_experts + kRouteLogits - 1) / kRouteLogits;
  const std::uint32_t warps = L.n_experts < kRouteLogits ? L.n_experts : kRouteLogits;
  route_kernel<<<dim3(rows, blocks, tasks.n), 32 * warps, route_smem(L), s>>>(L, b, tasks,
                                                                              x_staged, rows);
  return cudaGetLastError();
}

}  // namespace strata::cuda
