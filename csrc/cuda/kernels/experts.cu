// The expert passes on the device: the plan (an smap snapshot), grouping a pass's entries by
// expert, then gate/up with the activation fused and down with the mixture weight, as grouped
// matmuls: a block stages a tile of dequantized weight rows in shared memory and its warps take
// the group's entries (the prompt's rows that chose the expert, or decode's one or few), so a
// row is read from the arena once per pass whatever the number of rows, and x once per tile. The combine sums in j order.
// Every output element is one dot in dot.cuh's order: decode passes, prompt waves and any
// split give the same bits.
#include <algorithm>

#include "dot.cuh"
#include "kernels.h"
#include "mma_experts.h"
#include "weights.cuh"

namespace strata::cuda {
namespace {

constexpr std::uint32_t kThreads = 256;     // 8 warps
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

// h of entry i, output row r: the activation of its gate and up dots (biases added).
__device__ __forceinline__ void store_h(const DevLayout& L, const DevBuffers& b, std::uint32_t i,
                                        std::uint32_t r, float g, float u) {
  float h = activate(L, g, u);
  if ((L.plant & kPlantGateUp) && r == 0) h += 1.0f / 1024.0f;  // tests only
  b.h[std::size_t(i) * L.inter + r] = h;
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

// Block (group, tile of RT output rows): the tile's RT rows of gate and up, dequantized, staged
// in shared memory; then each warp takes whole entries (every row of the tile at once, so x is
// read once per tile) or, with fewer entries than warps (decode), (entry, row) pairs. Either
// way each (entry, row) is one dot in lane_dot's order: the same bits.
template <int RT>
__global__ void gate_up_kernel(DevLayout L, DevBuffers b) {
  const std::uint32_t g = blockIdx.x;
  if (g >= *b.groups_n) return;
  extern __shared__ float smem[];
  const std::uint32_t H = L.hidden, I = L.inter, k = L.top_k;
  const std::uint32_t Hp = (H + 7) / 8 * 8;
  float* gw = smem;            // [RT][Hp]
  float* uw = smem + RT * Hp;  // [RT][Hp]
  const unsigned char* rec = b.arena + std::uint64_t(b.group_slot[g]) * b.slot_bytes;
  const std::uint32_t* entries = b.group_entries + b.group_start[g];
  const std::uint32_t count = b.group_count[g];
  const std::uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = kThreads / 32;
  const std::uint32_t r0 = blockIdx.y * RT;
  const std::uint32_t nrows = I - r0 < RT ? I - r0 : RT;
  for (std::uint32_t q = 0; q < RT; ++q)
    for (std::uint32_t c0 = 8 * threadIdx.x; c0 < Hp; c0 += 8 * kThreads) {
      float v[8] = {}, u[8] = {};
      if (q < nrows) {
        load8(L, L.m[0], rec, r0 + q, c0, v);
        load8(L, L.m[1], rec, r0 + q, c0, u);
      }
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        gw[q * Hp + c0 + c] = v[c];
        uw[q * Hp + c0 + c] = u[c];
      }
    }
  __syncthreads();
  float gb[RT], ub[RT];
#pragma unroll
  for (int q = 0; q < RT; ++q) {
    gb[q] = q < int(nrows) ? bias_at(L, L.m[0], rec, r0 + q) : 0.0f;
    ub[q] = q < int(nrows) ? bias_at(L, L.m[1], rec, r0 + q) : 0.0f;
  }
  if (count >= warps) {
    for (std::uint32_t e = warp; e < count; e += warps) {
      const std::uint32_t i = entries[e];
      const float* x = b.x + std::size_t(i / k) * H;
      float ag[RT], au[RT];
#pragma unroll
      for (int q = 0; q < RT; ++q) ag[q] = au[q] = 0.0f;
      for (std::uint32_t c0 = 8 * lane; c0 < H; c0 += 8 * 32) {
        const std::uint32_t end = c0 + 8 < H ? c0 + 8 : H;
        for (std::uint32_t c = c0; c < end; ++c) {
          const float xv = x[c];
#pragma unroll
          for (int q = 0; q < RT; ++q) {
            ag[q] = __fmaf_rn(gw[q * Hp + c], xv, ag[q]);
            au[q] = __fmaf_rn(uw[q * Hp + c], xv, au[q]);
          }
        }
      }
#pragma unroll
      for (int q = 0; q < RT; ++q) {
        const float gd = warp_sum(ag[q]), ud = warp_sum(au[q]);
        if (lane == 0 && q < int(nrows)) store_h(L, b, i, r0 + q, gd + gb[q], ud + ub[q]);
      }
    }
  } else {
    for (std::uint32_t w = warp; w < count * nrows; w += warps) {
      const std::uint32_t i = entries[w / nrows], q = w % nrows;
      const float* x = b.x + std::size_t(i / k) * H;
      const float gd = warp_sum(lane_dot(gw + q * Hp, x, H, lane));
      const float ud = warp_sum(lane_dot(uw + q * Hp, x, H, lane));
      if (lane == 0) store_h(L, b, i, r0 + q, gd + gb[q], ud + ub[q]);
    }
  }
}

template <int RT>
__global__ void down_kernel(DevLayout L, DevBuffers b) {
  const std::uint32_t g = blockIdx.x;
  if (g >= *b.groups_n) return;
  extern __shared__ float smem[];
  const std::uint32_t H = L.hidden, I = L.inter;
  const std::uint32_t Ip = (I + 7) / 8 * 8;
  const unsigned char* rec = b.arena + std::uint64_t(b.group_slot[g]) * b.slot_bytes;
  const std::uint32_t* entries = b.group_entries + b.group_start[g];
  const std::uint32_t count = b.group_count[g];
  const std::uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = kThreads / 32;
  const std::uint32_t r0 = blockIdx.y * RT;
  const std::uint32_t nrows = H - r0 < RT ? H - r0 : RT;
  for (std::uint32_t q = 0; q < RT; ++q)
    for (std::uint32_t c0 = 8 * threadIdx.x; c0 < Ip; c0 += 8 * kThreads) {
      float v[8] = {};
      if (q < nrows) load8(L, L.m[2], rec, r0 + q, c0, v);
#pragma unroll
      for (int c = 0; c < 8; ++c) smem[q * Ip + c0 + c] = v[c];
    }
  __syncthreads();
  float db[RT];
#pragma unroll
  for (int q = 0; q < RT; ++q) db[q] = q < int(nrows) ? bias_at(L, L.m[2], rec, r0 + q) : 0.0f;
  if (count >= warps) {
    for (std::uint32_t e = warp; e < count; e += warps) {
      const std::uint32_t i = entries[e];
      const float* hv = b.h + std::size_t(i) * I;
      float a[RT];
#pragma unroll
      for (int q = 0; q < RT; ++q) a[q] = 0.0f;
      for (std::uint32_t c0 = 8 * lane; c0 < I; c0 += 8 * 32) {
        const std::uint32_t end = c0 + 8 < I ? c0 + 8 : I;
        for (std::uint32_t c = c0; c < end; ++c) {
          const float hx = hv[c];
#pragma unroll
          for (int q = 0; q < RT; ++q) a[q] = __fmaf_rn(smem[q * Ip + c], hx, a[q]);
        }
      }
#pragma unroll
      for (int q = 0; q < RT; ++q) {
        const float d = warp_sum(a[q]);
        if (lane == 0 && q < int(nrows))
          b.y[std::size_t(i) * H + r0 + q] = b.weights[i] * (d + db[q]);
      }
    }
  } else {
    for (std::uint32_t w = warp; w < count * nrows; w += warps) {
      const std::uint32_t i = entries[w / nrows], q = w % nrows;
      const float d = warp_sum(lane_dot(smem + q * Ip, b.h + std::size_t(i) * I, I, lane));
      if (lane == 0) b.y[std::size_t(i) * H + r0 + q] = b.weights[i] * (d + db[q]);
    }
  }
}

// Decode (fewer entries per expert than a block has warps): each warp takes R consecutive output
// rows of one group and, for each of the group's entries, their dots, the rows read and
// dequantized straight from the arena in lane_dot's order (lane l takes the chunks 8l, 8l + 256,
// ..., each chunk's columns in order), which are the staged kernels' products and sums exactly:
// the same bits, with no shared memory, no barrier, and every warp of the GPU at work (the staged
// kernels leave most of a block idle when a group has one entry).
//
// Speed is bytes in flight: a chunk step of a warp loads R rows' words (or floats) and scales
// and x's 8 columns (two 16-byte loads, shared by the R rows and, in gate_up, by gate and up),
// and the step loop is unrolled so that several steps' loads are issued before their products
// need them. The weight format is a template parameter (one instance each), so the dequantizing
// load has no format switch in the loop.
constexpr std::uint32_t kWarps = kThreads / 32;
// Output rows per warp (compile-time tuning knobs): the fastest gate_up + down pair measured on
// the H200 among 1x2, 2x4, 2x8 and 4x8 (docs/cuda.md; they differ by a few microseconds, 4x8's
// gate_up by far more: too few warps).
#ifndef STRATA_CUDA_GATE_UP_DIRECT_ROWS
#define STRATA_CUDA_GATE_UP_DIRECT_ROWS 1
#endif
#ifndef STRATA_CUDA_DOWN_DIRECT_ROWS
#define STRATA_CUDA_DOWN_DIRECT_ROWS 2
#endif
constexpr int kGateUpDirectRows = STRATA_CUDA_GATE_UP_DIRECT_ROWS;
constexpr int kDownDirectRows = STRATA_CUDA_DOWN_DIRECT_ROWS;

// x's columns [c0, c0 + 8): two 16-byte loads where the row allows them (n a multiple of 8, so
// every row starts 32-byte aligned), else one guarded load a column (0 past n).
__device__ __forceinline__ void load_x8(const float* x, std::uint32_t c0, std::uint32_t n,
                                        bool vec, float xv[8]) {
  if (vec) {
    const float4 a = *reinterpret_cast<const float4*>(x + c0);
    const float4 b = *reinterpret_cast<const float4*>(x + c0 + 4);
    xv[0] = a.x, xv[1] = a.y, xv[2] = a.z, xv[3] = a.w;
    xv[4] = b.x, xv[5] = b.y, xv[6] = b.z, xv[7] = b.w;
  } else {
#pragma unroll
    for (std::uint32_t c = 0; c < 8; ++c) xv[c] = c0 + c < n ? x[c0 + c] : 0.0f;
  }
}

// acc += w[c] * x[c] for the chunk's columns in order (those before n: a ragged last chunk of a
// float row stops where the row does, as lane_dot does).
template <bool Whole>
__device__ __forceinline__ float chunk_fma(const float w[8], const float xv[8], std::uint32_t c0,
                                           std::uint32_t n, float acc) {
#pragma unroll
  for (std::uint32_t c = 0; c < 8; ++c)
    if (Whole || c0 + c < n) acc = __fmaf_rn(w[c], xv[c], acc);
  return acc;
}

// One chunk step of a warp's decode dots: x's chunk at c0 against the chunk of rows r0 .. r0 + R
// of M matrices (gate and up, or down), accumulated into acc[m][q]. Whole: the row length is a
// multiple of 8 and every row is in range, so the step has no branch between its loads and its
// products (the unrolled steps' loads then issue together).
template <int F, int S, int R, int M, bool Whole>
__device__ __forceinline__ void direct_step(const DevLayout& L, const DevMatrix* mats,
                                            const unsigned char* rec, std::uint32_t r0,
                                            std::uint32_t rows, const float* x, std::uint32_t c0,
                                            std::uint32_t n, float (&acc)[M][R]) {
  float xv[8];
  load_x8(x, c0, n, Whole, xv);
#pragma unroll
  for (int q = 0; q < R; ++q) {
    if (!Whole && r0 + q >= rows) continue;
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float wv[8];
      load8<F, S>(L, mats[m], rec, r0 + q, c0, wv);
      acc[m][q] = chunk_fma<Whole>(wv, xv, c0, n, acc[m][q]);
    }
  }
}

// Lane `lane`'s shares of the R x M decode dots over a row of n columns: its chunks 8 lane,
// 8 lane + 256, ... in order, four steps at a time.
template <int F, int S, int R, int M>
__device__ __forceinline__ void direct_dots(const DevLayout& L, const DevMatrix* mats,
                                            const unsigned char* rec, std::uint32_t r0,
                                            std::uint32_t rows, const float* x, std::uint32_t n,
                                            std::uint32_t lane, float (&acc)[M][R]) {
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int q = 0; q < R; ++q) acc[m][q] = 0.0f;
  const std::uint32_t steps = 8 * lane < n ? (n - 8 * lane + 255) / 256 : 0;
  if (n % 8 == 0 && r0 + R <= rows) {
    std::uint32_t it = 0;
    for (; it + 4 <= steps; it += 4)
#pragma unroll
      for (std::uint32_t u = 0; u < 4; ++u)
        direct_step<F, S, R, M, true>(L, mats, rec, r0, rows, x, 8 * lane + 256 * (it + u), n,
                                      acc);
    // The last one to three steps, straight-line too (down's 768 columns are three steps).
    const std::uint32_t c = 8 * lane + 256 * it;
    switch (steps - it) {
      case 3:
        direct_step<F, S, R, M, true>(L, mats, rec, r0, rows, x, c, n, acc);
        direct_step<F, S, R, M, true>(L, mats, rec, r0, rows, x, c + 256, n, acc);
        direct_step<F, S, R, M, true>(L, mats, rec, r0, rows, x, c + 512, n, acc);
        break;
      case 2:
        direct_step<F, S, R, M, true>(L, mats, rec, r0, rows, x, c, n, acc);
        direct_step<F, S, R, M, true>(L, mats, rec, r0, rows, x, c + 256, n, acc);
        break;
      case 1: direct_step<F, S, R, M, true>(L, mats, rec, r0, rows, x, c, n, acc); break;
      default: break;
    }
  } else {
    for (std::uint32_t it = 0; it < steps; ++it)
      direct_step<F, S, R, M, false>(L, mats, rec, r0, rows, x, 8 * lane + 256 * it, n, acc);
  }
}

template <int F, int S, int R>
__global__ void gate_up_direct_kernel(DevLayout L, DevBuffers b) {
  const std::uint32_t g = blockIdx.x;
  // The group's slot, start and count are read before groups_n is known (g < n_experts keeps
  // them in bounds), so the four loads overlap instead of following one another.
  const std::uint32_t slot = b.group_slot[g], start = b.group_start[g], count = b.group_count[g];
  if (g >= *b.groups_n) return;
  const std::uint32_t H = L.hidden, I = L.inter, k = L.top_k;
  const std::uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const std::uint32_t r0 = (blockIdx.y * kWarps + warp) * R;
  if (r0 >= I) return;  // the whole warp: warp_sum's shuffles need every lane
  const unsigned char* rec = b.arena + std::uint64_t(slot) * b.slot_bytes;
  const std::uint32_t* entries = b.group_entries + start;
  float gb[R], ub[R];
#pragma unroll
  for (int q = 0; q < R; ++q) {
    const bool in = r0 + q < I;
    gb[q] = in ? bias_at(L, L.m[0], rec, r0 + q) : 0.0f;
    ub[q] = in ? bias_at(L, L.m[1], rec, r0 + q) : 0.0f;
  }
  for (std::uint32_t e = 0; e < count; ++e) {
    const std::uint32_t i = entries[e];
    float acc[2][R];
    direct_dots<F, S, R, 2>(L, L.m, rec, r0, I, b.x + std::size_t(i / k) * H, H, lane, acc);
#pragma unroll
    for (int q = 0; q < R; ++q) {
      const float gd = warp_sum(acc[0][q]), ud = warp_sum(acc[1][q]);
      if (lane == 0 && r0 + q < I) store_h(L, b, i, r0 + q, gd + gb[q], ud + ub[q]);
    }
  }
}

template <int F, int S, int R>
__global__ void down_direct_kernel(DevLayout L, DevBuffers b) {
  const std::uint32_t g = blockIdx.x;
  // The group's slot, start and count are read before groups_n is known (g < n_experts keeps
  // them in bounds), so the four loads overlap instead of following one another.
  const std::uint32_t slot = b.group_slot[g], start = b.group_start[g], count = b.group_count[g];
  if (g >= *b.groups_n) return;
  const std::uint32_t H = L.hidden, I = L.inter;
  const std::uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const std::uint32_t r0 = (blockIdx.y * kWarps + warp) * R;
  if (r0 >= H) return;  // the whole warp
  const unsigned char* rec = b.arena + std::uint64_t(slot) * b.slot_bytes;
  const std::uint32_t* entries = b.group_entries + start;
  float db[R];
#pragma unroll
  for (int q = 0; q < R; ++q) db[q] = r0 + q < H ? bias_at(L, L.m[2], rec, r0 + q) : 0.0f;
  for (std::uint32_t e = 0; e < count; ++e) {
    const std::uint32_t i = entries[e];
    float acc[1][R];
    direct_dots<F, S, R, 1>(L, L.m + 2, rec, r0, H, b.h + std::size_t(i) * I, I, lane, acc);
    const float w = b.weights[i];
#pragma unroll
    for (int q = 0; q < R; ++q) {
      const float d = warp_sum(acc[0][q]);
      if (lane == 0 && r0 + q < H) b.y[std::size_t(i) * H + r0 + q] = w * (d + db[q]);
    }
  }
}

// The decode kernels' instance for the pack's weight and scale formats, launched over (groups,
// row tiles).
template <int F, int S>
void launch_direct_as(const DevLayout& L, const DevBuffers& b, std::uint32_t groups, bool gate_up,
                      cudaStream_t s) {
  if (gate_up) {
    const std::uint32_t per_block = kWarps * kGateUpDirectRows;
    gate_up_direct_kernel<F, S, kGateUpDirectRows>
        <<<dim3(groups, (L.inter + per_block - 1) / per_block), kThreads, 0, s>>>(L, b);
  } else {
    const std::uint32_t per_block = kWarps * kDownDirectRows;
    down_direct_kernel<F, S, kDownDirectRows>
        <<<dim3(groups, (L.hidden + per_block - 1) / per_block), kThreads, 0, s>>>(L, b);
  }
}

template <int F>
cudaError_t launch_affine(const DevLayout& L, const DevBuffers& b, std::uint32_t groups,
                          bool gate_up, cudaStream_t s) {
  switch (L.scale_format) {
    case 0: launch_direct_as<F, 0>(L, b, groups, gate_up, s); break;
    case 1: launch_direct_as<F, 1>(L, b, groups, gate_up, s); break;
    case 2: launch_direct_as<F, 2>(L, b, groups, gate_up, s); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t launch_direct(const DevLayout& L, const DevBuffers& b, std::uint32_t groups,
                          bool gate_up, cudaStream_t s) {
  switch (L.format) {
    case 0: launch_direct_as<0, -1>(L, b, groups, gate_up, s); break;
    case 1: launch_direct_as<1, -1>(L, b, groups, gate_up, s); break;
    case 2: launch_direct_as<2, -1>(L, b, groups, gate_up, s); break;
    case 3: return launch_affine<3>(L, b, groups, gate_up, s);
    case 4: return launch_affine<4>(L, b, groups, gate_up, s);
    case 5: launch_direct_as<5, -1>(L, b, groups, gate_up, s); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

// Rows below this take the direct kernels: every group then has fewer entries than a block has
// warps (a token routes to an expert once), where the staged kernels would leave warps idle.
constexpr std::uint32_t kDirectBelowRows = kThreads / 32;

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

std::size_t padded_bytes(std::uint32_t n) { return std::size_t((n + 7) / 8) * 8 * 4; }
std::uint32_t max_groups(const DevLayout& L, std::uint32_t rows) {
  const std::uint32_t n = rows * L.top_k;
  return n < L.n_experts ? n : L.n_experts;
}

// Shared memory one tile may stage: the device's opt-in limit, capped at 100 KiB so that two
// blocks share a multiprocessor.
std::size_t smem_budget() {
  static const std::size_t budget = [] {
    int dev = 0, optin = 0;
    cudaGetDevice(&dev);
    if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) !=
        cudaSuccess)
      optin = 48 * 1024;
    return std::min<std::size_t>(std::size_t(optin), 100 * 1024);
  }();
  return budget;
}

// Rows per tile (8, 4, 2 or 1): the most whose staged rows fit the budget.
int rows_per_tile(std::size_t row_bytes) {
  for (int rt = 8; rt > 1; rt /= 2)
    if (std::size_t(rt) * row_bytes <= smem_budget()) return rt;
  return 1;
}
// gate_up stages a gate and an up row per output row; down one down row.
std::size_t gate_up_row_bytes(const DevLayout& L) { return 2 * padded_bytes(L.hidden); }
std::size_t down_row_bytes(const DevLayout& L) { return padded_bytes(L.inter); }

template <class Kernel>
cudaError_t allow_smem(Kernel k, std::size_t bytes) {
  return cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
}

}  // namespace

cudaError_t prepare_kernels(const DevLayout& L) {
  const int gu = rows_per_tile(gate_up_row_bytes(L)), dn = rows_per_tile(down_row_bytes(L));
  const std::size_t gu_bytes = gu * gate_up_row_bytes(L), dn_bytes = dn * down_row_bytes(L);
  cudaError_t e = cudaSuccess;
  switch (gu) {
    case 8: e = allow_smem(gate_up_kernel<8>, gu_bytes); break;
    case 4: e = allow_smem(gate_up_kernel<4>, gu_bytes); break;
    case 2: e = allow_smem(gate_up_kernel<2>, gu_bytes); break;
    default: e = allow_smem(gate_up_kernel<1>, gu_bytes); break;
  }
  if (e != cudaSuccess) return e;
  switch (dn) {
    case 8: return allow_smem(down_kernel<8>, dn_bytes);
    case 4: return allow_smem(down_kernel<4>, dn_bytes);
    case 2: return allow_smem(down_kernel<2>, dn_bytes);
    default: return allow_smem(down_kernel<1>, dn_bytes);
  }
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
  if (L.format == 2) return launch_gate_up_mma(L, b, rows, s);  // bf16: tensor cores, every row count
  const std::uint32_t groups = max_groups(L, rows);
  if (groups == 0) return cudaSuccess;
  if (rows < kDirectBelowRows) return launch_direct(L, b, groups, true, s);
  const int rt = rows_per_tile(gate_up_row_bytes(L));
  const std::size_t smem = rt * gate_up_row_bytes(L);
  const dim3 grid(groups, (L.inter + rt - 1) / rt);
  switch (rt) {
    case 8: gate_up_kernel<8><<<grid, kThreads, smem, s>>>(L, b); break;
    case 4: gate_up_kernel<4><<<grid, kThreads, smem, s>>>(L, b); break;
    case 2: gate_up_kernel<2><<<grid, kThreads, smem, s>>>(L, b); break;
    default: gate_up_kernel<1><<<grid, kThreads, smem, s>>>(L, b); break;
  }
  return cudaGetLastError();
}

cudaError_t launch_down(const DevLayout& L, const DevBuffers& b, std::uint32_t rows,
                        cudaStream_t s) {
  if (L.format == 2) return launch_down_mma(L, b, rows, s);  // bf16: tensor cores, every row count
  const std::uint32_t groups = max_groups(L, rows);
  if (groups == 0) return cudaSuccess;
  if (rows < kDirectBelowRows) return launch_direct(L, b, groups, false, s);
  const int rt = rows_per_tile(down_row_bytes(L));
  const std::size_t smem = rt * down_row_bytes(L);
  const dim3 grid(groups, (L.hidden + rt - 1) / rt);
  switch (rt) {
    case 8: down_kernel<8><<<grid, kThreads, smem, s>>>(L, b); break;
    case 4: down_kernel<4><<<grid, kThreads, smem, s>>>(L, b); break;
    case 2: down_kernel<2><<<grid, kThreads, smem, s>>>(L, b); break;
    default: down_kernel<1><<<grid, kThreads, smem, s>>>(L, b); break;
  }
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
