// Routing on the device: router logits (one warp per expert, the fixed 8-column dot order of
// dot.cuh), then the pack's rule (top-k by logit, ties to the lower index; the softmax sums in
// expert order), as cpu_kernels.cpp's route computes it. One launch runs a layer's route and its
// predictions (blockIdx.z picks the task): the same x, other routers.
//
// A token's logits are spread over several blocks (blockIdx.y), so a decode token's router
// (n_experts * hidden floats per task) is read by many multiprocessors at once rather than by
// one. Each block of kRouteLogits experts writes its logits to device scratch and the last block
// of a (token, task) to finish (an atomic counter per (token, task), reset by that block for the
// next launch) takes them (route_kernel). A thread-block cluster gathering the logits through
// distributed shared memory instead measured level with this
// (benchmarks/native/cuda_kernel_bench.cu), so the counter stays, the one way. A logit is the
// same dot in the same order whichever block computes it, the rule is one function
// (route_tail), and the selection keeps the sequential scan's result exactly (below), so the
// outputs are the bits one block per token gave.
#include <algorithm>
#include <mutex>

#include "dot.cuh"
#include "kernels.h"
#include "pdl.cuh"
#include "stage.cuh"

namespace strata::cuda {
namespace {

// Compile-time tuning knobs, set to what was fastest among 32, 16, 8 and 4 experts per block and
// a copy from 1 or 8 rows (benchmarks/native/cuda_kernel_bench.cu measures them; 4 and 8 level
// since the router rows are loaded first).
#ifndef STRATA_CUDA_ROUTE_LOGITS  // experts per block, one per warp
#define STRATA_CUDA_ROUTE_LOGITS 4
#endif
#ifndef STRATA_CUDA_ROUTE_COPY_ROWS  // below: kCopyStagedRows
#define STRATA_CUDA_ROUTE_COPY_ROWS 1
#endif
constexpr std::uint32_t kRouteLogits = STRATA_CUDA_ROUTE_LOGITS;
constexpr std::uint32_t kMaxTopK = 64;

// Router rows are read as 16-byte words, all of a batch's chunks issued before the first product
// needs them (written as a load loop, then a product loop: the compiler otherwise issues each
// chunk's loads right before its products, one memory round trip per chunk).
constexpr std::uint32_t kRouteSteps = 8;  // chunk steps a batch: a hidden of 2048 in one batch
struct RouterRow {
  float4 w[kRouteSteps][2];
};

// Lane `lane`'s chunks s0, s0 + 1, ... (of 8 columns each: 8 lane + 256 s) of router row w.
__device__ __forceinline__ void load_router(const float* w, std::uint32_t n, std::uint32_t lane,
                                            std::uint32_t s0, RouterRow& r) {
#pragma unroll
  for (std::uint32_t s = 0; s < kRouteSteps; ++s) {
    const std::uint32_t c = 8 * lane + 256 * (s0 + s);
    if (c < n) {
      r.w[s][0] = *reinterpret_cast<const float4*>(w + c);
      r.w[s][1] = *reinterpret_cast<const float4*>(w + c + 4);
    }
  }
}

// acc over the batch's chunks, each in column order: lane_dot's order.
__device__ __forceinline__ float fma_router(const RouterRow& r, const float* x, std::uint32_t n,
                                            std::uint32_t lane, std::uint32_t s0, float acc) {
#pragma unroll
  for (std::uint32_t s = 0; s < kRouteSteps; ++s) {
    const std::uint32_t c = 8 * lane + 256 * (s0 + s);
    if (c < n) {
      const float4 x0 = *reinterpret_cast<const float4*>(x + c);
      const float4 x1 = *reinterpret_cast<const float4*>(x + c + 4);
      const float4 w0 = r.w[s][0], w1 = r.w[s][1];
      acc = __fmaf_rn(w0.x, x0.x, acc);
      acc = __fmaf_rn(w0.y, x0.y, acc);
      acc = __fmaf_rn(w0.z, x0.z, acc);
      acc = __fmaf_rn(w0.w, x0.w, acc);
      acc = __fmaf_rn(w1.x, x1.x, acc);
      acc = __fmaf_rn(w1.y, x1.y, acc);
      acc = __fmaf_rn(w1.z, x1.z, acc);
      acc = __fmaf_rn(w1.w, x1.w, acc);
    }
  }
  return acc;
}

// The top-k of logit[0, E) into order[0, k), by the block's threads: round j of the sequential
// selection takes the largest logit not yet taken, ties to the lower index, i.e. (no logit NaN:
// a total order, value down then index up) the expert of rank j, where an expert's rank is the
// number of experts before it in that order. Each thread ranks its experts against all E. With
// a NaN among the logits the sequential scan's result depends on where the NaN sits; one
// thread then runs that scan itself.
__device__ void select_top_k(const float* logit, std::uint32_t E, std::uint32_t k,
                             std::uint32_t* order) {
  bool nan = false;
  for (std::uint32_t e = threadIdx.x; e < E; e += blockDim.x) nan = nan || isnan(logit[e]);
  if (__syncthreads_or(nan)) {
    if (threadIdx.x == 0)
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
    __syncthreads();
    return;
  }
  // Four logits a 16-byte shared load, four loads in flight (logit is 16-byte aligned where
  // vec4: the caller's layout), so the scan is not one shared-memory latency a logit.
  const bool vec4 = E % 4 == 0 && (reinterpret_cast<std::uintptr_t>(logit) & 15u) == 0;
  for (std::uint32_t e = threadIdx.x; e < E; e += blockDim.x) {
    const float v = logit[e];
    std::uint32_t rank = 0;
    auto before = [&](float u, std::uint32_t f) { return (u > v) | ((u == v) & (f < e)); };
    std::uint32_t f = 0;
    if (vec4) {
      const float4* l4 = reinterpret_cast<const float4*>(logit);
#pragma unroll 4
      for (; f < E; f += 4) {
        const float4 u = l4[f / 4];
        rank += before(u.x, f) + before(u.y, f + 1) + before(u.z, f + 2) + before(u.w, f + 3);
      }
    }
    for (; f < E; ++f) rank += before(logit[f], f);
    if (rank < k) order[rank] = e;
  }
  __syncthreads();
}

// The pack's rule for token t of one task, by the block's threads, from the token's logits in
// shared memory (logit[E], then room for ex [E], order [k] and w [k]): top-k, ids, weights.
__device__ void route_tail(const DevLayout& L, const RouteTask& task, std::uint32_t t,
                           float* logit) {
  const std::uint32_t E = L.n_experts, k = L.top_k;
  float* ex = logit + E;
  std::uint32_t* order = reinterpret_cast<std::uint32_t*>(ex + E);
  select_top_k(logit, E, k, order);
  for (std::uint32_t j = threadIdx.x; j < k; j += blockDim.x) {
    if (task.ids) task.ids[std::size_t(t) * k + j] = std::int32_t(order[j]);
    if (task.ids_back) task.ids_back[std::size_t(t) * k + j] = std::int32_t(order[j]);
  }
  if (!task.weights) return;
  const float top = logit[order[0]];
  // Each exp is one correctly placed call whichever thread computes it; the sums run on thread
  // 0 in the sequential order (experts ascending, then j ascending).
  if (L.routing == 0)
    for (std::uint32_t q = threadIdx.x; q < E; q += blockDim.x) ex[q] = expf(logit[q] - top);
  __syncthreads();
  if (threadIdx.x != 0) return;
  float* w = reinterpret_cast<float*>(order + k);  // [k], in shared memory (not local)
  if (L.routing == 0) {  // softmax over every expert, then the chosen (renormalised if asked)
    float total = 0;
    std::uint32_t q = 0;
    if (E % 4 == 0 && (reinterpret_cast<std::uintptr_t>(ex) & 15u) == 0) {
      const float4* e4 = reinterpret_cast<const float4*>(ex);
#pragma unroll 4
      for (; q < E; q += 4) {  // the same sum, in expert order: the loads only go ahead
        const float4 v = e4[q / 4];
        total += v.x;
        total += v.y;
        total += v.z;
        total += v.w;
      }
    }
    for (; q < E; ++q) total += ex[q];
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
#if STRATA_CUDA_PLANT  // tests only (device_types.h)
  if ((L.plant & kPlantRoute) && k > 1) w[1] *= 1.0f + 1.0f / 1024.0f;
#endif
  for (std::uint32_t j = 0; j < k; ++j) {
    task.weights[std::size_t(t) * k + j] = w[j];
    if (task.weights_back) task.weights_back[std::size_t(t) * k + j] = w[j];
  }
}

// Constant indices: a dynamic one would copy the tasks to local memory.
__device__ __forceinline__ RouteTask task_of(const RouteTasks& tasks, std::uint32_t z) {
  return z == 0 ? tasks.t[0] : z == 1 ? tasks.t[1] : tasks.t[2];
}

// What every block of a routing does: warp w computes the logit of expert e (that warp's, past
// E: none) of token t, returned on every lane of the warp. The block's x row lives in shared
// memory (x, H floats); x comes from the pinned staging the device thread filled (x_staged,
// mapped) or from device x. With x_staged the first block of the route task (store_x) also
// stores the row into device x, for the passes behind it. Launched early (pdl.cuh): each warp
// issues its router row's loads (routers are written only at bind) and then waits for the
// kernels before it, whose outputs (x, the scratch) it reads after.
__device__ __forceinline__ float block_logit(const DevLayout& L, const DevBuffers& b,
                                             const RouteTask& task, std::uint32_t t,
                                             std::uint32_t e, const float* x_staged, bool store_x,
                                             float* x) {
  const std::uint32_t E = L.n_experts, H = L.hidden;
  const std::uint32_t lane = threadIdx.x % 32;
  const float* router = b.routers + std::size_t(task.layer) * E * H;
  const bool vec = H % 8 == 0;
  RouterRow rw;
  if (e < E && vec) load_router(router + std::size_t(e) * H, H, lane, 0, rw);
  pdl_wait();
  pdl_trigger();
  const float* src = (x_staged ? x_staged : b.x) + std::size_t(t) * H;
  if (H % 4 == 0) {
    stage_floats(x, src, H, store_x ? b.x + std::size_t(t) * H : nullptr);
  } else {
    for (std::uint32_t c = threadIdx.x; c < H; c += blockDim.x) {
      const float v = src[c];
      x[c] = v;
      if (store_x) b.x[std::size_t(t) * H + c] = v;
    }
  }
  __syncthreads();
  if (e >= E) return 0.0f;
  if (!vec) return warp_sum(lane_dot(router + std::size_t(e) * H, x, H, lane));
  const float* w = router + std::size_t(e) * H;
  float acc = fma_router(rw, x, H, lane, 0, 0.0f);
  for (std::uint32_t s0 = kRouteSteps; 8 * lane + 256 * s0 < H; s0 += kRouteSteps) {
    load_router(w, H, lane, s0, rw);
    acc = fma_router(rw, x, H, lane, s0, acc);
  }
  return warp_sum(acc);
}

// Block (token t, expert block, task z): kRouteLogits experts, a warp each; their logits go to
// device scratch, and the last block of the (token, task) to finish takes the rule.
__global__ void route_kernel(DevLayout L, DevBuffers b, RouteTasks tasks, const float* x_staged,
                             std::uint32_t rows) {
  extern __shared__ float smem[];
  const std::uint32_t t = blockIdx.x, z = blockIdx.z;
  const RouteTask task = task_of(tasks, z);
  const std::uint32_t E = L.n_experts, H = L.hidden;
  const std::uint32_t e = blockIdx.y * kRouteLogits + threadIdx.x / 32;
  float* x = smem;  // [H], then (the last block) logit [E], ex [E], order [k], w [k]
  const float d = block_logit(L, b, task, t, e, x_staged, x_staged && z == 0 && blockIdx.y == 0, x);
  float* logits = b.logits + (std::size_t(z) * rows + t) * E;  // this (token, task)'s scratch
  if (e < E && threadIdx.x % 32 == 0) {
    logits[e] = d;
    __threadfence();  // the logit is visible GPU-wide before this block counts itself done
  }
  __syncthreads();
  __shared__ bool last;
  if (threadIdx.x == 0) {
    std::uint32_t* done = b.route_done + std::size_t(z) * rows + t;
    last = atomicAdd(done, 1u) == gridDim.y - 1;
    if (last) *done = 0;  // every block of this launch has counted: ready for the next one
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  float* logit = x + H;
  for (std::uint32_t q = threadIdx.x; q < E; q += blockDim.x)
    logit[q] = __ldcg(logits + q);  // from L2
  __syncthreads();
  route_tail(L, task, t, logit);
}

// x from the staging into device x, for a batch (below).
__global__ void copy_x_kernel(float* dst, const float* src, std::size_t n) {
  pdl_trigger();  // the route kernel behind it may start loading its routers
  for (std::size_t i = std::size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += std::size_t(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

// From this many rows the staged x is copied into device x first and every block reads it there
// (from L2); below it every block reads its row from the staging over PCIe, which saves a launch
// but costs rows * blocks rows of PCIe reads. Copying first won even for one decode token with
// the route and both predictions (benchmarks/native/cuda_kernel_bench.cu measures it), hence 1.
constexpr std::uint32_t kCopyStagedRows = STRATA_CUDA_ROUTE_COPY_ROWS;

std::size_t route_smem(const DevLayout& L) {
  return (std::size_t(L.hidden) + 2 * std::size_t(L.n_experts) + 2 * std::size_t(L.top_k)) * 4;
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
  static const bool early = pdl_capable(route_kernel);
  return launch(route_kernel, dim3(rows, blocks, tasks.n), dim3(32 * warps), route_smem(L), s,
                early, L, b, tasks, x_staged, rows);
}

}  // namespace strata::cuda
