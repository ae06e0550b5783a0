// The expert passes on the device: the plan (an smap snapshot), grouping a pass's entries by
// expert, then gate/up with the activation fused and down with the mixture weight, as grouped
// matmuls: a block stages a tile of dequantized weight rows in shared memory and its warps take
// the group's entries (the prompt's rows that chose the expert, or decode's one or few), so a
// row is read from the arena once per pass whatever the number of rows, and x once per tile. The combine sums in j order.
// Every output element is one dot in dot.cuh's order: decode passes, prompt waves and any
// split give the same bits.
#include <algorithm>

#include "activation.cuh"
#include "dot.cuh"
#include "kernels.h"
#include "mma_experts.h"
#include "wgmma_experts.h"
#include "pdl.cuh"
#include "weights.cuh"

namespace strata::cuda {
namespace {

constexpr std::uint32_t kThreads = 256;     // 8 warps
constexpr std::uint32_t kGroupThreads = 1024;

__device__ __forceinline__ std::uint32_t load_smap(const std::uint32_t* smap, std::uint32_t key) {
  // The host publishes with release stores; a volatile read sees the value it stored.
  return *reinterpret_cast<const volatile std::uint32_t*>(smap + key);
}

// h of entry i, output row r: the activation of its gate and up dots (biases added).
__device__ __forceinline__ void store_h(const DevLayout& L, const DevBuffers& b, std::uint32_t i,
                                        std::uint32_t r, float g, float u) {
  float h = activate_swiglu(L, g, u);
#if STRATA_CUDA_PLANT  // tests only (device_types.h)
  if ((L.plant & kPlantGateUp) && r == 0) h += 1.0f / 1024.0f;
#endif
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
// Output rows per warp (compile-time tuning knobs): the fastest gate_up + down pair among 1x2,
// 2x4, 2x8 and 4x8 (benchmarks/native/cuda_kernel_bench.cu measures them; 4 gate_up rows a warp
// leave too few warps).
#ifndef STRATA_CUDA_GATE_UP_DIRECT_ROWS
#define STRATA_CUDA_GATE_UP_DIRECT_ROWS 1
#endif
#ifndef STRATA_CUDA_DOWN_DIRECT_ROWS
#define STRATA_CUDA_DOWN_DIRECT_ROWS 2
#endif
constexpr int kGateUpDirectRows = STRATA_CUDA_GATE_UP_DIRECT_ROWS;
constexpr int kDownDirectRows = STRATA_CUDA_DOWN_DIRECT_ROWS;
// Output rows per warp of the loads-first decode kernels (below), compile-time knobs too: what
// tests/cuda/device_run.sh kernels chose by benchmarks/native/cuda_kernel_bench.cu (down's 4
// and 2 measure level; gate_up's 2 rows spill at the registers that keep 3 blocks a
// multiprocessor).
#ifndef STRATA_CUDA_GATE_UP_DECODE_ROWS
#define STRATA_CUDA_GATE_UP_DECODE_ROWS 1
#endif
#ifndef STRATA_CUDA_DOWN_DECODE_ROWS
#define STRATA_CUDA_DOWN_DECODE_ROWS 4
#endif
// gate_up's rows a warp on the lean path (decode_lean_gs: q4 with f16 scales): 2, at 80
// registers without spills; level with 1 by benchmarks/native/cuda_kernel_bench.cu, and what the
// CUDA suite runs.
#ifndef STRATA_CUDA_GATE_UP_DECODE_LEAN_ROWS
#define STRATA_CUDA_GATE_UP_DECODE_LEAN_ROWS 2
#endif
constexpr int kGateUpDecodeRows = STRATA_CUDA_GATE_UP_DECODE_ROWS;
constexpr int kDownDecodeRows = STRATA_CUDA_DOWN_DECODE_ROWS;
constexpr int kGateUpLeanRows = STRATA_CUDA_GATE_UP_DECODE_LEAN_ROWS;

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

// ---- The decode kernels, loads first ----
// The kernels above issue a chunk step's loads right before that step's products (the compiler
// keeps them there whatever the unrolling), so a warp waits one memory round trip per step: 8
// for gate_up's 2048 columns. These take the same chunks in the same order, but as a load loop
// over every step of a batch (all its weight words and scales in registers, in flight together)
// and then a product loop; the vector (x for gate_up, h for down) is staged once per entry in
// shared memory, shared by the block's warps, so a product loop reads it at shared-memory
// latency. A block is (group, 8 warps of R output rows); the group comes from kernel arguments
// when the host grouped the pass (DevBuffers::host_groups: no dependent read of the group
// table before the weights), else from the table after pdl_wait(). The weights are read before
// pdl_wait(): no kernel writes the arena (pdl.cuh). They need whole 8-column chunks (rows of a
// multiple of 8 columns, a group size dividing 256) and a vector that fits 48 KiB of shared
// memory; other shapes take the kernels above.

// A pass's groups as kernel arguments (the device arena: the device thread grouped the pass).
constexpr std::uint32_t kArgGroups = 128, kArgEntries = 512;
struct ArgGroups {
  std::uint32_t args = 0;  // 0: read the groups from device memory
  std::uint32_t n = 0;
  std::uint32_t slot[kArgGroups];
  std::uint16_t start[kArgGroups], count[kArgGroups];
  std::uint16_t entry[kArgEntries];
};

// A row's scales, one group a lane: for 16-bit scales (and mxfp4's e8m0 byte) each lane loads
// the scale and bias of groups lane and lane + 32 of its rows once, packed in one word, and a
// chunk step takes its group's word from the lane that holds it (a shuffle), instead of every
// lane loading its chunk's two scales at every step (two loads and two registers a chunk).
// Compile-time knob: 0 keeps every chunk's own scale loads (100 registers against shared
// scales' 64; faster under ncu, level by events: tests/cuda/device_run.sh kernels builds both,
// as `dps`, for benchmarks/native/cuda_kernel_bench.cu to compare side by side).
#ifndef STRATA_CUDA_DECODE_SHARED_SCALES
#define STRATA_CUDA_DECODE_SHARED_SCALES 1
#endif
template <int F, int S>
__host__ __device__ constexpr bool coop_scales() {
  return STRATA_CUDA_DECODE_SHARED_SCALES &&
         (F == 5 || ((F == 3 || F == 4) && (S == 1 || S == 2)));
}
constexpr std::uint32_t kCoopWords = 2;  // groups a lane holds: rows of up to 64 groups

// The weight bytes of one lane's chunk (8 columns of one row), as loaded.
template <int F>
struct Codes;
template <>
struct Codes<0> {  // f32: 8 floats
  uint4 a, b;
};
template <>
struct Codes<1> {  // f16: 8 halves
  uint4 a;
};
template <>
struct Codes<2> {  // bf16: 8 halves
  uint4 a;
};
template <>
struct Codes<3> {  // q4: one word of 8 codes
  std::uint32_t w;
};
template <>
struct Codes<4> {  // q8: two words of 4 codes
  uint2 w;
};
template <>
struct Codes<5> {  // mxfp4: one word of 8 codes
  std::uint32_t w;
};

// A chunk's codes and, for quantized formats whose scales are not shared by lanes, its group's
// scale and bias words.
template <int F, bool Scales>
struct RawChunk {
  Codes<F> c;
};
template <int F>
struct RawChunk<F, true> {
  Codes<F> c;
  std::uint32_t s, b;
};
template <int F, int S>
__host__ __device__ constexpr bool chunk_scales() {
  return F >= 3 && !coop_scales<F, S>();
}

// 32-bit registers a raw chunk holds; a batch's steps are as many as keep a warp's raw chunks
// near 64 registers (at least 1, at most Max: 8 for gate_up, whose 2048 columns are then one
// batch; 4 for down, whose 768 are 3 steps).
template <int F, int S>
__host__ __device__ constexpr int raw_regs() {
  return (F == 0 ? 8 : F == 1 || F == 2 ? 4 : F == 4 ? 2 : 1) + (chunk_scales<F, S>() ? 2 : 0);
}
template <int F, int S, int M, int R, int Max>
__host__ __device__ constexpr int batch_steps() {
  constexpr int n = 64 / (raw_regs<F, S>() * M * R);
  return n < 1 ? 1 : n > Max ? Max : n;
}

__device__ __forceinline__ std::uint32_t scale_word(const unsigned char* p, std::uint32_t i,
                                                    int fmt) {
  return fmt == 0 ? load_u32(p + 4 * std::size_t(i)) : load_u16(p + 2 * std::size_t(i));
}
__device__ __forceinline__ float scale_value(std::uint32_t v, int fmt) {
  return fmt == 0 ? __uint_as_float(v) : fmt == 1 ? half_bits(std::uint16_t(v))
                                                  : bf16_bits(std::uint16_t(v));
}

// Bytes of a row's codes a chunk step (256 columns) advances.
template <int F>
__host__ __device__ constexpr std::uint32_t step_bytes() {
  return F == 0 ? 1024 : F == 1 || F == 2 ? 512 : F == 4 ? 256 : 128;
}

// Lane `lane`'s first chunk of row r (column 8 lane): where its codes are.
template <int F>
__device__ __forceinline__ const unsigned char* lane_codes(const DevMatrix& m,
                                                           const unsigned char* rec,
                                                           std::uint32_t r, std::uint32_t lane) {
  const std::size_t row_bytes = std::size_t(m.cols) * step_bytes<F>() / 256;
  return rec + m.weight + std::size_t(r) * row_bytes + lane * (step_bytes<F>() / 32);
}

// One chunk's codes at p (and, with chunk scales, group g's scale words of row r).
template <int F, int S>
__device__ __forceinline__ void load_raw(const unsigned char* p, const DevMatrix& m,
                                         const unsigned char* rec, std::uint32_t r,
                                         std::uint32_t groups, std::uint32_t g,
                                         RawChunk<F, chunk_scales<F, S>()>& out) {
  if constexpr (F == 0) {
    out.c.a = reinterpret_cast<const uint4*>(p)[0];
    out.c.b = reinterpret_cast<const uint4*>(p)[1];
  } else if constexpr (F == 1 || F == 2) {
    out.c.a = *reinterpret_cast<const uint4*>(p);
  } else if constexpr (F == 4) {
    out.c.w = *reinterpret_cast<const uint2*>(p);
  } else {  // q4, mxfp4
    out.c.w = load_u32(p);
  }
  if constexpr (chunk_scales<F, S>()) {
    out.s = scale_word(rec + m.scales, r * groups + g, S);
    out.b = scale_word(rec + m.biases, r * groups + g, S);
  }
}

// Group gi of row r as one word: the scale in the low half and the bias in the high (16-bit
// formats), or the e8m0 byte (mxfp4).
template <int F, int S>
__device__ __forceinline__ std::uint32_t load_coop(const DevMatrix& m, const unsigned char* rec,
                                                   std::uint32_t r, std::uint32_t groups,
                                                   std::uint32_t gi) {
  if constexpr (F == 5) {
    return rec[m.scales + std::size_t(r) * groups + gi];
  } else {
    const std::size_t i = std::size_t(r) * groups + gi;
    return std::uint32_t(load_u16(rec + m.scales + 2 * i)) |
           (std::uint32_t(load_u16(rec + m.biases + 2 * i)) << 16);
  }
}

// The exponents that make a code masked in place a float (code_float): magic.m[j] is the bits
// of 2^(23 - 4j), in registers (the compiler would otherwise rebuild the constants at every
// step); built from a value it cannot fold (DevLayout::plant & 0, 0 in every run).
struct Magic {
  std::uint32_t m[4];
};
__device__ __forceinline__ Magic make_magic(std::uint32_t zero) {
  Magic g;
#pragma unroll
  for (int j = 0; j < 4; ++j) g.m[j] = (std::uint32_t(150 - 4 * j) << 23) | zero;
  return g;
}

// Code q = (w >> Shift) & (2^Bits - 1), masked in place, as a float: with the exponent of
// 2^(23 - Shift) above it the word is the float 2^(23 - Shift) + q (the code sits in the
// mantissa's bits from Shift up, whose unit is 1), and the subtraction is exact. The mask and
// the exponent's OR are one instruction (the compiler otherwise emits two).
template <int Shift, int Bits>
__device__ __forceinline__ float code_float(std::uint32_t w, const Magic& g) {
  static_assert(Shift % 4 == 0 && Shift + Bits <= 16);
  constexpr std::uint32_t mask = ((1u << Bits) - 1u) << Shift;
  std::uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(w), "n"(mask), "r"(g.m[Shift / 4]));
  return __fsub_rn(__uint_as_float(d), float(1u << (23 - Shift)));
}

// The chunk's 8 weights, the same floats as load8's. s and b: the group's scale and bias
// (quantized formats). With f16 scales the affine s * q + b is one fused multiply-add: s has 11
// significant bits and q at most 8, so s * q is exact in float32 (and at least 2^-24, far from
// underflow), so rounding s * q + b once is rounding it twice. The codes are masked in place and
// read as floats by their place's exponent (code_float): no shift a code, no scaled scale.
template <int F, int S>
__device__ __forceinline__ void dequant(const Codes<F>& c, float s, float b, const Magic& g,
                                        float v[8]) {
  if constexpr (F == 0) {
    v[0] = __uint_as_float(c.a.x), v[1] = __uint_as_float(c.a.y);
    v[2] = __uint_as_float(c.a.z), v[3] = __uint_as_float(c.a.w);
    v[4] = __uint_as_float(c.b.x), v[5] = __uint_as_float(c.b.y);
    v[6] = __uint_as_float(c.b.z), v[7] = __uint_as_float(c.b.w);
  } else if constexpr (F == 1 || F == 2) {
    const std::uint32_t u[4] = {c.a.x, c.a.y, c.a.z, c.a.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const std::uint16_t lo = std::uint16_t(u[i] & 0xFFFFu), hi = std::uint16_t(u[i] >> 16);
      v[2 * i] = F == 1 ? half_bits(lo) : bf16_bits(lo);
      v[2 * i + 1] = F == 1 ? half_bits(hi) : bf16_bits(hi);
    }
  } else if constexpr (F == 3 && S == 1) {
    const std::uint32_t lo = c.w, hi = c.w >> 16;
    v[0] = __fmaf_rn(s, code_float<0, 4>(lo, g), b);
    v[1] = __fmaf_rn(s, code_float<4, 4>(lo, g), b);
    v[2] = __fmaf_rn(s, code_float<8, 4>(lo, g), b);
    v[3] = __fmaf_rn(s, code_float<12, 4>(lo, g), b);
    v[4] = __fmaf_rn(s, code_float<0, 4>(hi, g), b);
    v[5] = __fmaf_rn(s, code_float<4, 4>(hi, g), b);
    v[6] = __fmaf_rn(s, code_float<8, 4>(hi, g), b);
    v[7] = __fmaf_rn(s, code_float<12, 4>(hi, g), b);
  } else if constexpr (F == 4 && S == 1) {
    const std::uint32_t h[4] = {c.w.x, c.w.x >> 16, c.w.y, c.w.y >> 16};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[2 * i] = __fmaf_rn(s, code_float<0, 8>(h[i], g), b);
      v[2 * i + 1] = __fmaf_rn(s, code_float<8, 8>(h[i], g), b);
    }
  } else if constexpr (F == 3) {
#pragma unroll
    for (int i = 0; i < 8; ++i)
      v[i] = __fadd_rn(__fmul_rn(s, small_uint_float((c.w >> (4 * i)) & 15u)), b);
  } else if constexpr (F == 4) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[i] = __fadd_rn(__fmul_rn(s, small_uint_float((c.w.x >> (8 * i)) & 255u)), b);
      v[4 + i] = __fadd_rn(__fmul_rn(s, small_uint_float((c.w.y >> (8 * i)) & 255u)), b);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = __fmul_rn(fp4((c.w >> (4 * i)) & 15u), s);
  }
}

// A packed group word (load_coop) as its scale and bias.
template <int F, int S>
__device__ __forceinline__ void unpack_coop(std::uint32_t p, float& s, float& b) {
  if constexpr (F == 5) {
    s = e8m0(std::uint8_t(p)), b = 0.0f;
  } else if constexpr (S == 1) {
    s = half_bits(std::uint16_t(p)), b = half_bits(std::uint16_t(p >> 16));
  } else {
    s = __uint_as_float(p << 16), b = __uint_as_float(p & 0xFFFF0000u);
  }
}

// Where a warp's chunk step finds its groups. The step's 256 columns are gs = 256 / G groups
// (gs divides 32), all in one 32-group block of the row: word j = (S gs) / 32 of lane
// (S gs) % 32 + g0, g0 = 8 lane / G being the lane's group inside the step.
struct StepGroups {
  std::uint32_t groups, g0, gs;
};

// One warp's share of a decode block: rows r0 .. r0 + R of the M matrices (gate and up, or
// down), in batches of NS chunk steps (chunk s of lane l at column 8 l + 256 s). The warp steps
// uniformly (ws steps: lane 0's count); a lane whose chunk lies past the row skips it.
template <int F, int S, int R, int M, int NS>
struct DirectWarp {
  static constexpr bool kCoop = coop_scales<F, S>();
  RawChunk<F, chunk_scales<F, S>()> raw[NS][M][R];
  std::uint32_t coop[M][R][kCoop ? kCoopWords : 1];

  __device__ __forceinline__ void load_groups(const DevMatrix* mats, const unsigned char* rec,
                                              std::uint32_t r0, std::uint32_t lane,
                                              const StepGroups& sg) {
    if constexpr (kCoop) {
#pragma unroll
      for (int m = 0; m < M; ++m)
#pragma unroll
        for (int q = 0; q < R; ++q)
#pragma unroll
          for (std::uint32_t j = 0; j < kCoopWords; ++j) {
            const std::uint32_t gi = lane + 32 * j;
            coop[m][q][j] = gi < sg.groups ? load_coop<F, S>(mats[m], rec, r0 + q, sg.groups, gi)
                                           : 0u;
          }
    }
  }

  __device__ __forceinline__ void load(const DevMatrix* mats, const unsigned char* rec,
                                       std::uint32_t r0, std::uint32_t lane, std::uint32_t n,
                                       std::uint32_t ws, std::uint32_t s0, const StepGroups& sg) {
    const unsigned char* p[M][R];  // the rows' codes at this lane's chunk of step s0
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int q = 0; q < R; ++q)
        p[m][q] = lane_codes<F>(mats[m], rec, r0 + q, lane) + std::size_t(s0) * step_bytes<F>();
#pragma unroll
    for (int s = 0; s < NS; ++s) {
      if (s0 + s >= ws) break;
      if (8 * lane + 256 * (s0 + s) >= n) continue;
      const std::uint32_t g = sg.g0 + (s0 + s) * sg.gs;
#pragma unroll
      for (int q = 0; q < R; ++q)
#pragma unroll
        for (int m = 0; m < M; ++m)
          load_raw<F, S>(p[m][q] + s * step_bytes<F>(), mats[m], rec, r0 + q, sg.groups, g,
                         raw[s][m][q]);
    }
  }

  // The lean path (GS > 0: group size GS, the row a multiple of 256 columns, one batch): the
  // same loads and products as load() and fma() with s0 = 0, but every lane's chunk is in the
  // row (no per-lane branch) and each step's group words are at compile-time places (which word
  // of coop, which lane: g0 plus a constant), so a step issues no index arithmetic or select.
  template <int GS>
  __device__ __forceinline__ void load_lean(const DevMatrix* mats, const unsigned char* rec,
                                            std::uint32_t r0, std::uint32_t lane,
                                            std::uint32_t ws, std::uint32_t groups) {
    const unsigned char* p[M][R];
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int q = 0; q < R; ++q) p[m][q] = lane_codes<F>(mats[m], rec, r0 + q, lane);
    const std::uint32_t g0 = 8 * lane / GS;
#pragma unroll
    for (int s = 0; s < NS; ++s) {
      if (s >= int(ws)) break;
#pragma unroll
      for (int q = 0; q < R; ++q)
#pragma unroll
        for (int m = 0; m < M; ++m)
          load_raw<F, S>(p[m][q] + s * step_bytes<F>(), mats[m], rec, r0 + q, groups,
                         g0 + std::uint32_t(s) * (256 / GS), raw[s][m][q]);
    }
  }

  template <int GS>
  __device__ __forceinline__ void fma_lean(const float* v, std::uint32_t lane, std::uint32_t ws,
                                           const Magic& magic, float (&acc)[M][R]) const {
    const std::uint32_t g0 = 8 * lane / GS;
#pragma unroll
    for (int s = 0; s < NS; ++s) {
      if (s >= int(ws)) break;
      const float4 a = *reinterpret_cast<const float4*>(v + 8 * lane + 256 * s);
      const float4 b = *reinterpret_cast<const float4*>(v + 8 * lane + 256 * s + 4);
      const float xv[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
      constexpr std::uint32_t gs = 256 / GS;
#pragma unroll
      for (int q = 0; q < R; ++q)
#pragma unroll
        for (int m = 0; m < M; ++m) {
          float sc = 0.0f, bi = 0.0f;
          if constexpr (kCoop) {
            const std::uint32_t gb = std::uint32_t(s) * gs;  // a constant once unrolled
            unpack_coop<F, S>(__shfl_sync(kFullMask, coop[m][q][gb >> 5], (gb & 31u) + g0), sc,
                              bi);
          } else if constexpr (F >= 3) {
            sc = scale_value(raw[s][m][q].s, S);
            bi = scale_value(raw[s][m][q].b, S);
          }
          float w[8];
          dequant<F, S>(raw[s][m][q].c, sc, bi, magic, w);
          acc[m][q] = chunk_fma<true>(w, xv, 0, 0, acc[m][q]);
        }
    }
  }

  // acc[m][q] += the batch's chunks against the staged vector v, each chunk in column order.
  __device__ __forceinline__ void fma(const float* v, std::uint32_t lane, std::uint32_t n,
                                      std::uint32_t ws, std::uint32_t s0, const StepGroups& sg,
                                      const Magic& magic, float (&acc)[M][R]) const {
#pragma unroll
    for (int s = 0; s < NS; ++s) {
      if (s0 + s >= ws) break;
      const std::uint32_t c = 8 * lane + 256 * (s0 + s);
      // The step's group words, on every lane (a shuffle needs the whole warp).
      std::uint32_t word[M][R];
      if constexpr (kCoop) {
        const std::uint32_t gb = (s0 + s) * sg.gs;  // the step's first group
#pragma unroll
        for (int q = 0; q < R; ++q)
#pragma unroll
          for (int m = 0; m < M; ++m)
            word[m][q] = __shfl_sync(kFullMask, (gb >> 5) == 0 ? coop[m][q][0] : coop[m][q][1],
                                     (gb & 31u) + sg.g0);
      }
      if (c >= n) continue;  // this lane's chunk lies past the row
      const float4 a = *reinterpret_cast<const float4*>(v + c);
      const float4 b = *reinterpret_cast<const float4*>(v + c + 4);
      const float xv[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
      for (int q = 0; q < R; ++q)
#pragma unroll
        for (int m = 0; m < M; ++m) {
          float sc = 0.0f, bi = 0.0f;
          if constexpr (kCoop) {
            unpack_coop<F, S>(word[m][q], sc, bi);
          } else if constexpr (F >= 3) {
            sc = scale_value(raw[s][m][q].s, S);
            bi = scale_value(raw[s][m][q].b, S);
          }
          float w[8];
          dequant<F, S>(raw[s][m][q].c, sc, bi, magic, w);
          acc[m][q] = chunk_fma<true>(w, xv, c, 0, acc[m][q]);
        }
    }
  }
};

// Block (group, tile of kWarps * R output rows). GateUp: h of the group's entries (M = 2: gate
// and up, x of the entry's token); else y (M = 1: down, the entry's h).
// Blocks a multiprocessor should hold where a raw chunk is one word (q4, mxfp4 with shared
// scales): 4 (64 registers a thread) for up to 2 rows a warp (gate_up's 2 matrices of 1, down's
// 2), 3 for up to 4; else what the compiler needs. (No spills at these, by ptxas -v.)
template <int F, int S, int R, bool GateUp>
__host__ __device__ constexpr int decode_steps() {
  return batch_steps<F, S, GateUp ? 2 : 1, R, GateUp ? 8 : 4>();
}
// Down on the lean path (GS > 0) asks for STRATA_CUDA_DOWN_DECODE_MIN_BLOCKS (compile-time
// knob; 0: the rule above), 4 by default: at its 4 rows a warp that puts Qwen3's 512 down blocks
// (8 experts by 64 row tiles) in one wave of Hopper's 132 multiprocessors, where 3 left 116
// blocks to a second (the same bits, a shorter down: benchmarks/native/cuda_kernel_bench.cu
// measures it). ptxas fits the lean instances in 64 registers without spills; the general ones
// spill there, so keep the rule.
#ifndef STRATA_CUDA_DOWN_DECODE_MIN_BLOCKS
#define STRATA_CUDA_DOWN_DECODE_MIN_BLOCKS 4
#endif
template <int F, int S, int P, bool GateUp, int GS>
__host__ __device__ constexpr int decode_min_blocks() {
  if (!((F == 3 || F == 5) && coop_scales<F, S>())) return 1;
  if (!GateUp && GS > 0 && STRATA_CUDA_DOWN_DECODE_MIN_BLOCKS > 0)
    return STRATA_CUDA_DOWN_DECODE_MIN_BLOCKS;
  return P <= 2 ? 4 : P <= 4 ? 3 : 1;
}

// GS > 0: the lean path (DirectWarp::load_lean), for a group size of GS, a row of a multiple of
// 256 columns and one batch (decode_lean_gs); 0: any shape the kernel takes.
template <int F, int S, int R, bool GateUp, int GS = 0>
__global__ void __launch_bounds__(kThreads,
                                  decode_min_blocks<F, S, (GateUp ? 2 : 1) * R, GateUp, GS>())
    decode_kernel(DevLayout L, DevBuffers b, ArgGroups ag) {
  constexpr int M = GateUp ? 2 : 1;
  constexpr int NS = decode_steps<F, S, R, GateUp>();
  extern __shared__ float vs[];  // the entry's vector: n floats
  const std::uint32_t g = blockIdx.x;
  std::uint32_t slot, start, count;
  if (ag.args) {
    if (g >= ag.n) return;
    slot = ag.slot[g], start = ag.start[g], count = ag.count[g];
  } else {
    pdl_wait();  // the group kernel before this one wrote the table
    slot = b.group_slot[g], start = b.group_start[g], count = b.group_count[g];
    if (g >= *b.groups_n) return;
  }
  const std::uint32_t H = L.hidden, I = L.inter, k = L.top_k;
  const std::uint32_t rows = GateUp ? I : H, n = GateUp ? H : I;
  const DevMatrix* mats = GateUp ? L.m : L.m + 2;
  const std::uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const std::uint32_t r0 = (blockIdx.y * kWarps + warp) * R;
  const bool active = r0 < rows;  // whole warps (every row of an active warp is in range)
  const unsigned char* rec = b.arena + std::uint64_t(slot) * b.slot_bytes;
  const std::uint32_t ws = (n + 255) / 256;  // the warp's chunk steps
  const std::uint32_t G = F >= 3 ? L.group_size : 256;
  const StepGroups sg{n / G, 8 * lane / G, 256 / G};
  const bool one_batch = ws <= std::uint32_t(NS);
  const Magic magic = make_magic(L.plant & 0u);
  DirectWarp<F, S, R, M, NS> dw;
  if (active) {
    if constexpr (GS > 0)
      dw.template load_lean<GS>(mats, rec, r0, lane, ws, sg.groups);
    else if (one_batch)
      dw.load(mats, rec, r0, lane, n, ws, 0, sg);
    dw.load_groups(mats, rec, r0, lane, sg);
  }
  float bias[M][R];
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int q = 0; q < R; ++q) bias[m][q] = active ? bias_at(L, mats[m], rec, r0 + q) : 0.0f;
  pdl_trigger();
  pdl_wait();  // x or h, and the routing weights, come from the kernels before
  for (std::uint32_t e = 0; e < count; ++e) {
    const std::uint32_t i = ag.args ? ag.entry[start + e] : b.group_entries[start + e];
    const float* src = GateUp ? b.x + std::size_t(i / k) * H : b.h + std::size_t(i) * I;
    if (e > 0) __syncthreads();  // every warp is done with the previous entry's vector
    for (std::uint32_t c = 4 * threadIdx.x; c < n; c += 4 * kThreads)
      *reinterpret_cast<float4*>(vs + c) = *reinterpret_cast<const float4*>(src + c);
    __syncthreads();
    if (!active) continue;
    float acc[M][R];
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int q = 0; q < R; ++q) acc[m][q] = 0.0f;
    if constexpr (GS > 0) {
      dw.template fma_lean<GS>(vs, lane, ws, magic, acc);
    } else if (one_batch) {
      dw.fma(vs, lane, n, ws, 0, sg, magic, acc);
    } else {
      for (std::uint32_t s0 = 0; s0 < ws; s0 += NS) {
        dw.load(mats, rec, r0, lane, n, ws, s0, sg);
        dw.fma(vs, lane, n, ws, s0, sg, magic, acc);
      }
    }
    if constexpr (GateUp) {
#pragma unroll
      for (int q = 0; q < R; ++q) {
        const float gd = warp_sum(acc[0][q]), ud = warp_sum(acc[1][q]);
        if (lane == 0) store_h(L, b, i, r0 + q, gd + bias[0][q], ud + bias[1][q]);
      }
    } else {
      const float w = b.weights[i];
#pragma unroll
      for (int q = 0; q < R; ++q) {
        const float d = warp_sum(acc[0][q]);
        if (lane == 0) b.y[std::size_t(i) * H + r0 + q] = w * (d + bias[0][q]);
      }
    }
  }
}

// Whether the loads-first kernels take this shape (else the kernels above do).
template <int F, int S>
bool decode_kernel_fits(const DevLayout& L, bool gate_up, int R) {
  const std::uint32_t rows = gate_up ? L.inter : L.hidden, n = gate_up ? L.hidden : L.inter;
  const DevMatrix& m = L.m[gate_up ? 0 : 2];
  if (n % 8 != 0 || rows % std::uint32_t(R) != 0 || n * 4 > 48 * 1024) return false;
  if (m.rows != rows || m.cols != n) return false;
  if (L.format >= 3 && (L.group_size < 8 || 256 % L.group_size != 0 || n % L.group_size != 0))
    return false;
  if (coop_scales<F, S>() && n / L.group_size > 32 * kCoopWords) return false;
  return true;
}

// The groups as kernel arguments, from the host's copy of the table (laid out as the device
// one: DevBuffers::host_groups), when they fit; else args = 0.
ArgGroups arg_groups(const DevLayout& L, const DevBuffers& b) {
  ArgGroups ag;
  if (!b.host_groups) return ag;
  const std::uint32_t E = L.n_experts;
  const std::uint32_t* t = b.host_groups;
  const std::uint32_t n = t[0];
  if (n > kArgGroups) return ag;
  std::uint32_t entries = 0;
  for (std::uint32_t g = 0; g < n; ++g) entries = std::max(entries, t[1 + E + g] + t[1 + 2 * E + g]);
  if (entries > kArgEntries) return ag;
  ag.args = 1;
  ag.n = n;
  for (std::uint32_t g = 0; g < n; ++g) {
    ag.slot[g] = t[1 + g];
    ag.start[g] = std::uint16_t(t[1 + E + g]);
    ag.count[g] = std::uint16_t(t[1 + 2 * E + g]);
  }
  for (std::uint32_t i = 0; i < entries; ++i) ag.entry[i] = std::uint16_t(t[1 + 8 * E + i]);
  return ag;
}

// The lean path's group size for this shape (DirectWarp::load_lean), or 0: quantized formats
// whose lanes share scales, group sizes of 32, 64 or 128, rows of a multiple of 256 columns in
// one batch.
// q4 with f16 scales shared by lanes: where the lean path was measured. (Other formats' lean
// instances spilled at the kernels' register bounds, q4 with bf16 scales and mxfp4 1.3 KB a
// thread and more, or took up to 192 registers, q8.)
template <int F, int S>
constexpr bool lean_format() {
  return F == 3 && S == 1 && coop_scales<F, S>();
}
template <int F, int S, int R, bool GateUp>
std::uint32_t decode_lean_gs(const DevLayout& L) {
  const std::uint32_t n = GateUp ? L.hidden : L.inter;
  if (!lean_format<F, S>() || n % 256 != 0 ||
      n / 256 > std::uint32_t(decode_steps<F, S, R, GateUp>()))
    return 0;
  const std::uint32_t G = L.group_size;
  return G == 32 || G == 64 || G == 128 ? G : 0;
}

template <int F, int S, int R, bool GateUp, int GS>
cudaError_t launch_decode_as(const DevLayout& L, const DevBuffers& b, const ArgGroups& ag,
                             std::uint32_t groups, cudaStream_t s) {
  const std::uint32_t rows = GateUp ? L.inter : L.hidden, n = GateUp ? L.hidden : L.inter;
  const std::uint32_t per_block = kWarps * R;
  static const bool early = pdl_capable(decode_kernel<F, S, R, GateUp, GS>);
  // Before pdl_wait() the kernel reads the arena (which no kernel writes) and, from the group
  // table, what gate_up does not write: down may start behind gate_up, and gate_up too when its
  // groups are arguments (a group kernel before it may be writing the table).
  return launch(decode_kernel<F, S, R, GateUp, GS>,
                dim3(groups, (rows + per_block - 1) / per_block), dim3(kThreads),
                std::size_t(n) * 4, s, early && (!GateUp || ag.args), L, b, ag);
}

// LeanOnly: the caller checked that the lean path takes the shape (no general instance at R).
template <int F, int S, int R, bool GateUp, bool LeanOnly = false>
cudaError_t launch_decode(const DevLayout& L, const DevBuffers& b, std::uint32_t groups,
                          cudaStream_t s) {
  const ArgGroups ag = arg_groups(L, b);
  if (ag.args) {
    if (ag.n == 0) return cudaSuccess;  // nothing to compute (an unpublished expert: reported)
    groups = ag.n;
  }
  if constexpr (lean_format<F, S>()) {
    switch (decode_lean_gs<F, S, R, GateUp>(L)) {
      case 32: return launch_decode_as<F, S, R, GateUp, 32>(L, b, ag, groups, s);
      case 64: return launch_decode_as<F, S, R, GateUp, 64>(L, b, ag, groups, s);
      case 128: return launch_decode_as<F, S, R, GateUp, 128>(L, b, ag, groups, s);
      default: break;
    }
  }
  if constexpr (LeanOnly) return cudaErrorInvalidValue;
  else return launch_decode_as<F, S, R, GateUp, 0>(L, b, ag, groups, s);
}

// The decode kernels' instance for the pack's weight and scale formats, launched over (groups,
// row tiles).
template <int F, int S>
cudaError_t launch_direct_as(const DevLayout& L, const DevBuffers& b, std::uint32_t groups,
                             bool gate_up, cudaStream_t s) {
  if constexpr (lean_format<F, S>() && kGateUpLeanRows != kGateUpDecodeRows) {
    if (gate_up && decode_kernel_fits<F, S>(L, true, kGateUpLeanRows) &&
        decode_lean_gs<F, S, kGateUpLeanRows, true>(L) != 0)
      return launch_decode<F, S, kGateUpLeanRows, true, true>(L, b, groups, s);
  }
  if (gate_up && decode_kernel_fits<F, S>(L, true, kGateUpDecodeRows))
    return launch_decode<F, S, kGateUpDecodeRows, true>(L, b, groups, s);
  if (!gate_up && decode_kernel_fits<F, S>(L, false, kDownDecodeRows))
    return launch_decode<F, S, kDownDecodeRows, false>(L, b, groups, s);
  if (gate_up) {
    const std::uint32_t per_block = kWarps * kGateUpDirectRows;
    gate_up_direct_kernel<F, S, kGateUpDirectRows>
        <<<dim3(groups, (L.inter + per_block - 1) / per_block), kThreads, 0, s>>>(L, b);
  } else {
    const std::uint32_t per_block = kWarps * kDownDirectRows;
    down_direct_kernel<F, S, kDownDirectRows>
        <<<dim3(groups, (L.hidden + per_block - 1) / per_block), kThreads, 0, s>>>(L, b);
  }
  return cudaGetLastError();
}

template <int F>
cudaError_t launch_affine(const DevLayout& L, const DevBuffers& b, std::uint32_t groups,
                          bool gate_up, cudaStream_t s) {
  switch (L.scale_format) {
    case 0: return launch_direct_as<F, 0>(L, b, groups, gate_up, s);
    case 1: return launch_direct_as<F, 1>(L, b, groups, gate_up, s);
    case 2: return launch_direct_as<F, 2>(L, b, groups, gate_up, s);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t launch_direct(const DevLayout& L, const DevBuffers& b, std::uint32_t groups,
                          bool gate_up, cudaStream_t s) {
  switch (L.format) {
    case 0: return launch_direct_as<0, -1>(L, b, groups, gate_up, s);
    case 1: return launch_direct_as<1, -1>(L, b, groups, gate_up, s);
    case 2: return launch_direct_as<2, -1>(L, b, groups, gate_up, s);
    case 3: return launch_affine<3>(L, b, groups, gate_up, s);
    case 4: return launch_affine<4>(L, b, groups, gate_up, s);
    case 5: return launch_direct_as<5, -1>(L, b, groups, gate_up, s);
    default: return cudaErrorInvalidValue;
  }
}

// Rows below this take the direct kernels: every group then has fewer entries than a block has
// warps (a token routes to an expert once), where the staged kernels would leave warps idle.
constexpr std::uint32_t kDirectBelowRows = kThreads / 32;

template <int F, int S>
bool decode_fits_both(const DevLayout& L) {
  return decode_kernel_fits<F, S>(L, true, kGateUpDecodeRows) &&
         decode_kernel_fits<F, S>(L, false, kDownDecodeRows);
}

// Launched early behind down (pdl.cuh): its blocks are resident when down's last ones finish.
__global__ void combine_kernel(DevLayout L, DevBuffers b, std::uint32_t rows) {
  pdl_wait();
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

// A staged pass's kernel and shared memory for this shape: rows_per_tile's instance of gate_up
// or down (one signature, so one pointer), staging that many rows.
struct StagedKernel {
  void (*kernel)(DevLayout, DevBuffers);
  int rows_per_tile;
  std::size_t smem;
};
StagedKernel staged_kernel(const DevLayout& L, bool gate_up) {
  const std::size_t row_bytes = gate_up ? gate_up_row_bytes(L) : down_row_bytes(L);
  const int rt = rows_per_tile(row_bytes);
  const auto pick = [gate_up](auto gu, auto dn) -> void (*)(DevLayout, DevBuffers) {
    return gate_up ? gu : dn;
  };
  void (*k)(DevLayout, DevBuffers) = rt == 8   ? pick(gate_up_kernel<8>, down_kernel<8>)
                                     : rt == 4 ? pick(gate_up_kernel<4>, down_kernel<4>)
                                     : rt == 2 ? pick(gate_up_kernel<2>, down_kernel<2>)
                                               : pick(gate_up_kernel<1>, down_kernel<1>);
  return {k, rt, std::size_t(rt) * row_bytes};
}

// A pass of the float and affine formats: the decode kernels below kDirectBelowRows rows, else
// the staged ones over (groups, row tiles).
cudaError_t launch_pass(const DevLayout& L, const DevBuffers& b, std::uint32_t rows,
                        bool gate_up, cudaStream_t s) {
  const std::uint32_t groups = max_groups(L, rows);
  if (groups == 0) return cudaSuccess;
  if (rows < kDirectBelowRows) return launch_direct(L, b, groups, gate_up, s);
  const StagedKernel k = staged_kernel(L, gate_up);
  const std::uint32_t out_rows = gate_up ? L.inter : L.hidden;
  const dim3 grid(groups, (out_rows + k.rows_per_tile - 1) / k.rows_per_tile);
  k.kernel<<<grid, kThreads, k.smem, s>>>(L, b);
  return cudaGetLastError();
}

}  // namespace

cudaError_t prepare_kernels(const DevLayout& L) {
  for (const bool gate_up : {true, false}) {
    const StagedKernel k = staged_kernel(L, gate_up);
    const cudaError_t e = cudaFuncSetAttribute(
        k.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(k.smem));
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

bool groups_as_arguments(const DevLayout& L, std::uint32_t rows) {
  if (rows == 0 || rows >= kDirectBelowRows) return false;
  const std::uint32_t n = rows * L.top_k;
  if (n > kArgEntries || std::min(n, L.n_experts) > kArgGroups) return false;
  switch (L.format) {  // bf16 (2) is left to its own kernels' choice: the table stays uploaded
    case 0: return decode_fits_both<0, -1>(L);
    case 1: return decode_fits_both<1, -1>(L);
    case 3:
    case 4:
      switch (L.scale_format) {
        case 0: return L.format == 3 ? decode_fits_both<3, 0>(L) : decode_fits_both<4, 0>(L);
        case 1: return L.format == 3 ? decode_fits_both<3, 1>(L) : decode_fits_both<4, 1>(L);
        case 2: return L.format == 3 ? decode_fits_both<3, 2>(L) : decode_fits_both<4, 2>(L);
        default: return false;
      }
    case 5: return decode_fits_both<5, -1>(L);
    default: return false;
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

namespace {
// bf16's family for a pass of `rows` (DevLayout::bf16_wgmma).
bool takes_wgmma(const DevLayout& L, std::uint32_t rows) {
  const auto family = Bf16Family(L.bf16_wgmma);
  return family == Bf16Family::Wgmma || (family == Bf16Family::Auto && rows >= kWgmmaFromRows);
}
}  // namespace

cudaError_t launch_gate_up(const DevLayout& L, const DevBuffers& b, std::uint32_t rows,
                           cudaStream_t s) {
  if (L.format == 2)  // bf16: tensor cores, every row count
    return takes_wgmma(L, rows) ? launch_gate_up_wgmma(L, b, rows, s)
                                : launch_gate_up_mma(L, b, rows, s);
  return launch_pass(L, b, rows, true, s);
}

cudaError_t launch_down(const DevLayout& L, const DevBuffers& b, std::uint32_t rows,
                        cudaStream_t s) {
  if (L.format == 2)  // bf16: tensor cores, every row count
    return takes_wgmma(L, rows) ? launch_down_wgmma(L, b, rows, s)
                                : launch_down_mma(L, b, rows, s);
  return launch_pass(L, b, rows, false, s);
}

cudaError_t launch_combine(const DevLayout& L, const DevBuffers& b, std::uint32_t rows,
                           cudaStream_t s) {
  const std::size_t n = std::size_t(rows) * L.hidden;
  if (n == 0) return cudaSuccess;
  static const bool early = pdl_capable(combine_kernel);
  return launch(combine_kernel, dim3(unsigned((n + 255) / 256)), dim3(256), 0, s, early, L, b,
                rows);
}

}  // namespace strata::cuda
