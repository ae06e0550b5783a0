// The expert passes on the device: the plan (an smap snapshot), grouping a pass's entries by
// expert, then gate/up with the activation fused and down with the mixture weight, as grouped
// matmuls: a block stages one dequantized weight row in shared memory and its warps take the
// group's entries (the prompt's rows that chose the expert, or decode's one or few), so a row is
// read from the arena once per pass whatever the number of rows. The combine sums in j order.
// Every output element is one dot in dot.cuh's order: decode passes, prompt waves and any
// split give the same bits.
#include "dot.cuh"
#include "kernels.h"
#include "weights.cuh"

namespace strata::cuda {
namespace {

constexpr std::uint32_t kThreads = 256;     // 8 warps
constexpr std::uint32_t kRowsPerBlock = 4;  // output rows one block computes, one at a time
constexpr std::uint32_t kGroupThreads = 1024;

__device__ __forceinline__ std::uint32_t load_smap(const std::uint32_t* smap, std::uint32_t key) {
  // The host publishes with release stores; a volatile read sees the value it stored.
  return *reinterpret_cast<const volatile std::uint32_t*>(smap + key);
}

__device__ __forceinline__ float activate(const DevLayout& L, float g, float u) {
  if (L.activation == 0) return (g / (1.0f + expf(-g))) * u;  // silu(g) * u
  // gpt-oss: the gate clipped from above only, the linear part both ways and shifted by one.
  const float lim = L.act_limit;
  const float gc = fminf(g, lim);
  const float uc = fminf(fmaxf(u, -lim), lim);
  return (uc + 1.0f) * (gc / (1.0f + expf(-L.act_alpha * gc)));
}

__global__ void plan_kernel(DevLayout L, DevBuffers b, std::uint32_t layer, std::uint32_t n) {
  const std::uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) b.plan[i] = load_smap(b.smap, layer * L.n_experts + std::uint32_t(b.ids[i]));
}

__device__ __forceinline__ bool accepts(const DevBuffers& b, Select sel, std::uint32_t i,
                                        std::uint32_t e) {
  if (sel == Select::Resident) return b.plan[i] != kAbsentSlot;
  if (sel == Select::Missing) return b.plan[i] == kAbsentSlot;
  return b.in_wave[e] != 0;
}

// One block. Entry order inside a group is not fixed (atomics), and need not be: each entry's
// outputs are computed alone.
__global__ void group_kernel(DevLayout L, DevBuffers b, std::uint32_t layer, std::uint32_t n,
                             Select sel) {
  const std::uint32_t E = L.n_experts;
  __shared__ bool failed;
  for (std::uint32_t e = threadIdx.x; e < E; e += blockDim.x) {
    b.expert_count[e] = 0;
    b.expert_first[e] = 0xFFFFFFFFu;
    b.in_wave[e] = 0;
  }
  __syncthreads();
  if (sel == Select::Wave)
    for (std::uint32_t w = threadIdx.x; w < *b.wave_n; w += blockDim.x)
      b.in_wave[std::uint32_t(b.wave[w])] = 1;
  __syncthreads();
  for (std::uint32_t i = threadIdx.x; i < n; i += blockDim.x) {
    const std::uint32_t e = std::uint32_t(b.ids[i]);
    if (!accepts(b, sel, i, e)) continue;
    atomicAdd(&b.expert_count[e], 1u);
    atomicMin(&b.expert_first[e], i);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    failed = false;
    std::uint32_t groups = 0, offset = 0;
    for (std::uint32_t e = 0; e < E && !failed; ++e) {
      const std::uint32_t c = b.expert_count[e];
      if (c == 0) continue;
      // Resident: the slot the plan saw (I8 keeps it valid). Missing and waves: published by
      // now (the host released this pass only after it was).
      const std::uint32_t slot = sel == Select::Resident ? b.plan[b.expert_first[e]]
                                                         : load_smap(b.smap, layer * E + e);
      if (slot == kAbsentSlot || slot >= b.n_slots) {
        if (atomicCAS(&b.error->flag, 0u, 1u) == 0u) {
          b.error->layer = layer;
          b.error->expert = e;
          b.error->what = std::uint32_t(sel);
          __threadfence_system();
        }
        failed = true;
        break;
      }
      b.group_slot[groups] = slot;
      b.group_start[groups] = offset;
      b.group_count[groups] = c;
      b.expert_cursor[e] = offset;
      offset += c;
      ++groups;
    }
    *b.groups_n = failed ? 0 : groups;  // an unpublished expert: nothing is computed
  }
  __syncthreads();
  if (failed) return;
  for (std::uint32_t i = threadIdx.x; i < n; i += blockDim.x) {
    const std::uint32_t e = std::uint32_t(b.ids[i]);
    if (!accepts(b, sel, i, e)) continue;
    b.group_entries[atomicAdd(&b.expert_cursor[e], 1u)] = i;
  }
}

// Block (group, row tile): for each of its output rows r, gate row r and up row r dequantized
// into shared memory, then one warp per entry.
__global__ void gate_up_kernel(DevLayout L, DevBuffers b) {
  const std::uint32_t g = blockIdx.x;
  if (g >= *b.groups_n) return;
  extern __shared__ float smem[];
  const std::uint32_t H = L.hidden, I = L.inter, k = L.top_k;
  float* gw = smem;
  float* uw = smem + ((H + 7) / 8) * 8;
  const unsigned char* rec = b.arena + std::uint64_t(b.group_slot[g]) * b.slot_bytes;
  const std::uint32_t* entries = b.group_entries + b.group_start[g];
  const std::uint32_t count = b.group_count[g];
  const std::uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const std::uint32_t r0 = blockIdx.y * kRowsPerBlock;
  for (std::uint32_t r = r0; r < r0 + kRowsPerBlock && r < I; ++r) {
    __syncthreads();  // the previous row's dots are done with the staged row
    for (std::uint32_t c0 = 8 * threadIdx.x; c0 < H; c0 += 8 * kThreads) {
      float v[8], u[8];
      load8(L, L.m[0], rec, r, c0, v);
      load8(L, L.m[1], rec, r, c0, u);
#pragma unroll
      for (int q = 0; q < 8; ++q) {
        gw[c0 + q] = v[q];
        uw[c0 + q] = u[q];
      }
    }
    __syncthreads();
    const float gb = bias_at(L, L.m[0], rec, r), ub = bias_at(L, L.m[1], rec, r);
    for (std::uint32_t q = warp; q < count; q += kThreads / 32) {
      const std::uint32_t i = entries[q];
      const float* x = b.x + std::size_t(i / k) * H;
      const float gd = warp_sum(lane_dot(gw, x, H, lane));
      const float ud = warp_sum(lane_dot(uw, x, H, lane));
      if (lane == 0) {
        float h = activate(L, gd + gb, ud + ub);
        if ((L.plant & kPlantGateUp) && r == 0) h += 1.0f / 1024.0f;
        b.h[std::size_t(i) * I + r] = h;
      }
    }
  }
}

__global__ void down_kernel(DevLayout L, DevBuffers b) {
  const std::uint32_t g = blockIdx.x;
  if (g >= *b.groups_n) return;
  extern __shared__ float smem[];
  const std::uint32_t H = L.hidden, I = L.inter;
  const unsigned char* rec = b.arena + std::uint64_t(b.group_slot[g]) * b.slot_bytes;
  const std::uint32_t* entries = b.group_entries + b.group_start[g];
  const std::uint32_t count = b.group_count[g];
  const std::uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const std::uint32_t r0 = blockIdx.y * kRowsPerBlock;
  for (std::uint32_t r = r0; r < r0 + kRowsPerBlock && r < H; ++r) {
    __syncthreads();
    for (std::uint32_t c0 = 8 * threadIdx.x; c0 < I; c0 += 8 * kThreads) {
      float v[8];
      load8(L, L.m[2], rec, r, c0, v);
#pragma unroll
      for (int q = 0; q < 8; ++q) smem[c0 + q] = v[q];
    }
    __syncthreads();
    const float db = bias_at(L, L.m[2], rec, r);
    for (std::uint32_t q = warp; q < count; q += kThreads / 32) {
      const std::uint32_t i = entries[q];
      const float d = warp_sum(lane_dot(smem, b.h + std::size_t(i) * I, I, lane));
      if (lane == 0) b.y[std::size_t(i) * H + r] = b.weights[i] * (d + db);
    }
  }
}

__global__ void combine_kernel(DevLayout L, DevBuffers b, std::uint32_t rows) {
  const std::uint32_t H = L.hidden, k = L.top_k;
  const std::size_t n = std::size_t(rows) * H;
  const std::size_t idx = std::size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= n) return;
  const std::size_t t = idx / H, c = idx % H;
  const float* y = b.y + t * k * H + c;
  float o = y[0];
  for (std::uint32_t j = 1; j < k; ++j) o += y[std::size_t(j) * H];
  b.out[idx] = o;
}

std::size_t gate_up_smem(const DevLayout& L) { return 2 * std::size_t((L.hidden + 7) / 8) * 8 * 4; }
std::size_t down_smem(const DevLayout& L) { return std::size_t((L.inter + 7) / 8) * 8 * 4; }
std::uint32_t max_groups(const DevLayout& L, std::uint32_t rows) {
  const std::uint32_t n = rows * L.top_k;
  return n < L.n_experts ? n : L.n_experts;
}

}  // namespace

cudaError_t prepare_kernels(const DevLayout& L) {
  cudaError_t e = cudaFuncSetAttribute(gate_up_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       int(gate_up_smem(L)));
  if (e != cudaSuccess) return e;
  return cudaFuncSetAttribute(down_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              int(down_smem(L)));
}

cudaError_t launch_plan(const DevLayout& L, const DevBuffers& b, std::uint32_t layer,
                        std::uint32_t rows, cudaStream_t s) {
  const std::uint32_t n = rows * L.top_k;
  if (n == 0) return cudaSuccess;
  plan_kernel<<<(n + 255) / 256, 256, 0, s>>>(L, b, layer, n);
  return cudaGetLastError();
}

cudaError_t launch_group(const DevLayout& L, const DevBuffers& b, std::uint32_t layer,
                         std::uint32_t rows, Select select, cudaStream_t s) {
  group_kernel<<<1, kGroupThreads, 0, s>>>(L, b, layer, rows * L.top_k, select);
  return cudaGetLastError();
}

cudaError_t launch_gate_up(const DevLayout& L, const DevBuffers& b, std::uint32_t rows,
                           cudaStream_t s) {
  const std::uint32_t groups = max_groups(L, rows);
  if (groups == 0) return cudaSuccess;
  const dim3 grid(groups, (L.inter + kRowsPerBlock - 1) / kRowsPerBlock);
  gate_up_kernel<<<grid, kThreads, gate_up_smem(L), s>>>(L, b);
  return cudaGetLastError();
}

cudaError_t launch_down(const DevLayout& L, const DevBuffers& b, std::uint32_t rows,
                        cudaStream_t s) {
  const std::uint32_t groups = max_groups(L, rows);
  if (groups == 0) return cudaSuccess;
  const dim3 grid(groups, (L.hidden + kRowsPerBlock - 1) / kRowsPerBlock);
  down_kernel<<<grid, kThreads, down_smem(L), s>>>(L, b);
  return cudaGetLastError();
}

cudaError_t launch_combine(const DevLayout& L, const DevBuffers& b, std::uint32_t rows,
                           cudaStream_t s) {
  const std::size_t n = std::size_t(rows) * L.hidden;
  if (n == 0) return cudaSuccess;
  combine_kernel<<<unsigned((n + 255) / 256), 256, 0, s>>>(L, b, rows);
  return cudaGetLastError();
}

}  // namespace strata::cuda
