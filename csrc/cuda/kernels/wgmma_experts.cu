// gate_up and down for the bf16 weight format on Hopper's tensor cores (wgmma, sm_90a), at every
// row count (decode's one token too), so that a token's output is the same bits alone and in any
// batch (I11, issue 19's batch-size rule). Hopper only. Faster prompts, slower decode than
// mma_experts.cu's mma.sync family (benchmarks/cuda_prompt.py measures both), so by default
// (STRATA_CUDA_BF16=auto) the backend takes it for passes of kWgmmaFromRows rows and more and
// mma.sync below, once a known-answer check found the two families' bits equal on the GPU
// (host/bf16_families.cpp), so that a token's bits do not depend on which family its pass took;
// STRATA_CUDA_BF16=wgmma takes it for every bf16 pass.
//
// Arithmetic. A bf16 weight is an exact bf16 value; each float32 activation (x for gate_up, h
// for down) is split exactly into three bf16 pieces, x = hi + mid + lo (mma.cuh), so every
// product w * piece is exact in float32 and only the order of the sums differs from the CPU
// backend. The order is one per output element, fixed by the row length alone: the weight
// matrix is the wgmma's A operand (64 output rows a warpgroup), the tokens its B operand (N of
// them, 8 to 128 in steps of 8, zero columns past the chunk's tokens), k in blocks of 16 strictly
// in order, and in each k-block
//   hi_acc = wgmma(W, hi, hi_acc);  rest = wgmma(W, mid, rest);  rest = wgmma(W, lo, rest);
// then out = (hi_acc + rest) + bias. Two accumulators, not one: `rest` is about 2^-8 of hi_acc,
// so its own rounding is negligible and hi_acc's is that of one bf16 GEMM's float32 sum (the
// tensor core's, fixed by the hardware). An element's result depends only on its row of W, its
// token's column and its own accumulator, never on N or the other columns, the tile, the grid,
// the chunk or the pass: the same bits at every arena size, split, wave and batch. The three
// wgmmas of a k-block have one shape, so the hardware keeps their order on `rest` (PTX: the
// accumulator accesses of wgmmas of the same shape are ordered without a fence).
//
// A block is WGS warpgroups over a tile of 64 * WGS output rows (for gate_up the same rows of
// gate and of up, in the same warpgroup, so the activation fuses in registers) and a chunk of up
// to BN of its group's tokens, looping over the group's chunks. Its threads stage k-stages of 64
// columns into a ring of shared memory (cp.async, 16 bytes each, into the 128-byte swizzle the
// wgmma descriptors read): the tile's weight rows and the chunk's activation pieces. Prompts
// (from 8 rows) stage the pieces from device scratch, split once a pass (x by a small kernel
// before gate_up, h by gate_up itself as it writes h); decode (and a backend without the
// scratch) stages the float32 rows and each thread splits the ones it copied. A k-stage is one
// barrier: the copies of the stage S - 2 ahead are issued behind it, then the stage's wgmmas,
// and the warpgroup waits for the stage before's (so one stage of wgmmas is always in flight and
// the buffers rewritten next are two stages old). Only the chunk's tokens, rounded up to the
// instruction's step, are staged and multiplied: a chunk of n tokens takes the instance of the
// kernel's loop whose N is n rounded up.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

#include "activation.cuh"
#include "pieces.cuh"
#include "wgmma.cuh"
#include "wgmma_experts.h"
#include "weights.cuh"

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "wgmma_experts.cu uses wgmma: build it for sm_90a (-gencode=arch=compute_90a,code=sm_90a)"
#endif

namespace strata::cuda {
namespace {

// Bench only (benchmarks/native/cuda_prompt_bench.cu builds it): x rounded to bf16 alone (one
// wgmma a k-block, torch's arithmetic), to show what the exact split costs. Never in the backend.
#ifdef STRATA_CUDA_MMA_ONE_PIECE_BENCH
constexpr int kPieces = 1;
#else
constexpr int kPieces = 3;
#endif

template <int WGS_, int BN_, int STEP_, int STAGES_>
struct Tiling {
  static constexpr int WGS = WGS_;        // warpgroups a block, each 64 output rows (per matrix)
  static constexpr int BN = BN_;          // tokens a chunk, at most
  static constexpr int STEP = STEP_;      // an instruction's N: the chunk's tokens rounded up to it
  static constexpr int STAGES = STAGES_;  // the ring's k-stages, at most (fewer where shared
                                          // memory is short)
  static constexpr int kThreads = 128 * WGS;
  static constexpr int BM = 64 * WGS;  // output rows a block, per matrix
  static_assert(BN % STEP == 0 && STEP % 8 == 0 && BN <= 128, "N: 8 to 128 in steps of 8");
};

// Compile-time tuning knobs (tests/cuda/device_run.sh prompt builds neighbours of these, checks
// their outputs bitwise against the defaults' and times them): for decode (below 8 rows) the
// ring's depth; for prompts below SMALL_BELOW_ROWS rows the small tiling's warpgroups, tokens a
// chunk, token step and ring depth, from there the large tiling's (its down pass with tokens of
// its own); and whether prompts stage the pieces from the scratch (1) or split float32 rows in
// every block (0). The defaults are the fastest benchmarks/cuda_prompt.py measured, within the
// registers:
// a large gate_up chunk of 64 tokens (128 accumulators a thread), or a down chunk of 96, spills.
// None changes an output bit.
#ifndef STRATA_CUDA_WGMMA_DECODE_STAGES
#define STRATA_CUDA_WGMMA_DECODE_STAGES 8
#endif
#ifndef STRATA_CUDA_WGMMA_SMALL_BELOW_ROWS
#define STRATA_CUDA_WGMMA_SMALL_BELOW_ROWS 512
#endif
#ifndef STRATA_CUDA_WGMMA_SMALL_WARPGROUPS
#define STRATA_CUDA_WGMMA_SMALL_WARPGROUPS 2
#endif
#ifndef STRATA_CUDA_WGMMA_SMALL_TOKENS
#define STRATA_CUDA_WGMMA_SMALL_TOKENS 32
#endif
#ifndef STRATA_CUDA_WGMMA_SMALL_STEP
#define STRATA_CUDA_WGMMA_SMALL_STEP 8
#endif
#ifndef STRATA_CUDA_WGMMA_SMALL_STAGES
#define STRATA_CUDA_WGMMA_SMALL_STAGES 5
#endif
#ifndef STRATA_CUDA_WGMMA_PROMPT_WARPGROUPS
#define STRATA_CUDA_WGMMA_PROMPT_WARPGROUPS 2
#endif
#ifndef STRATA_CUDA_WGMMA_PROMPT_TOKENS
#define STRATA_CUDA_WGMMA_PROMPT_TOKENS 48
#endif
#ifndef STRATA_CUDA_WGMMA_PROMPT_DOWN_TOKENS
#define STRATA_CUDA_WGMMA_PROMPT_DOWN_TOKENS 64
#endif
#ifndef STRATA_CUDA_WGMMA_PROMPT_STEP
#define STRATA_CUDA_WGMMA_PROMPT_STEP 16
#endif
#ifndef STRATA_CUDA_WGMMA_PROMPT_STAGES
#define STRATA_CUDA_WGMMA_PROMPT_STAGES 5
#endif
#ifndef STRATA_CUDA_WGMMA_PROMPT_PIECES
#define STRATA_CUDA_WGMMA_PROMPT_PIECES 1
#endif

using DecodeTiling = Tiling<1, 8, 8, STRATA_CUDA_WGMMA_DECODE_STAGES>;
template <bool GateUp>
using SmallTiling = Tiling<STRATA_CUDA_WGMMA_SMALL_WARPGROUPS, STRATA_CUDA_WGMMA_SMALL_TOKENS,
                           STRATA_CUDA_WGMMA_SMALL_STEP, STRATA_CUDA_WGMMA_SMALL_STAGES>;
template <bool GateUp>
using PromptTiling =
    Tiling<STRATA_CUDA_WGMMA_PROMPT_WARPGROUPS,
           GateUp ? STRATA_CUDA_WGMMA_PROMPT_TOKENS : STRATA_CUDA_WGMMA_PROMPT_DOWN_TOKENS,
           STRATA_CUDA_WGMMA_PROMPT_STEP, STRATA_CUDA_WGMMA_PROMPT_STAGES>;
constexpr bool kPromptPieces = STRATA_CUDA_WGMMA_PROMPT_PIECES != 0;
constexpr std::uint32_t kSmallBelowRows = STRATA_CUDA_WGMMA_SMALL_BELOW_ROWS;

// Rows below this take the decode tiling (experts.cu's kDirectBelowRows, the same boundary).
constexpr std::uint32_t kDecodeBelowRows = 8;
constexpr int BK = 64;           // a k-stage's columns: one 128-byte swizzled row of bf16
constexpr int kRowBytes = 128;   // a staged row of a k-stage
constexpr std::size_t kSmemLimit = 227 * 1024;  // a block's shared memory on Hopper

// Groups a block's table of work items holds (a pass of more walks the group counts, 32 a step;
// a knob so that the bench can check the walk bitwise against the table).
#ifndef STRATA_CUDA_WGMMA_TABLE_GROUPS
#define STRATA_CUDA_WGMMA_TABLE_GROUPS 256
#endif
constexpr int kTableGroups = STRATA_CUDA_WGMMA_TABLE_GROUPS;

// A block's shared memory: the ring's stages (each the weight rows, the activation pieces and,
// where the block splits float32 rows itself with cp.async, those rows), then the chunk's
// tables and the table of work items.
template <class T, int Mats, bool XRing>
struct Smem {
  static constexpr std::size_t a = std::size_t(Mats) * T::BM * kRowBytes;
  static constexpr std::size_t p = std::size_t(kPieces) * T::BN * kRowBytes;
  static constexpr std::size_t x = XRing ? std::size_t(T::BN) * BK * 4 : 0;
  static constexpr std::size_t stage = a + p + x;
  static constexpr std::size_t fixed =
      2 * std::size_t(T::BN) * (sizeof(void*) + 4) + (kTableGroups + 32) * 4;
  static constexpr std::size_t fit = (kSmemLimit - fixed) / stage;
  static constexpr int S = int(fit < std::size_t(T::STAGES) ? fit : std::size_t(T::STAGES));
  static_assert(S >= 3, "the ring needs three stages at least");
  static constexpr std::size_t bytes = fixed + S * stage;
};

// The float's pieces (one: bf16(x), bench only).
__device__ __forceinline__ void pieces_of(float x, std::uint16_t (&p)[3]) {
  if constexpr (kPieces == 3) {
    split3(x, p[0], p[1], p[2]);
  } else {
    p[0] = bf16_rn(x), p[1] = p[2] = 0;
  }
}

// A group of `count` tokens in chunks of at most BN, as even as the step allows (each chunk's N
// is its own tokens rounded up to the step, so even chunks waste the least): the chunk size.
__device__ __forceinline__ std::uint32_t chunk_size(std::uint32_t count, std::uint32_t bn,
                                                    std::uint32_t step) {
  const std::uint32_t even = (count + bn - 1) / bn;
  const std::uint32_t per = (count + even - 1) / even;
  return (per + step - 1) / step * step;
}
// Its work items: `tiles` row tiles of each of its chunks.
__device__ __forceinline__ std::uint32_t items_of(std::uint32_t count, std::uint32_t bn,
                                                  std::uint32_t step, std::uint32_t tiles) {
  if (count == 0) return 0;
  const std::uint32_t size = chunk_size(count, bn, step);
  return (count + size - 1) / size * tiles;
}

// A work item: (group, row tile, chunk of the group's tokens). find() fills the first part (its
// loads left in flight), resolve() the rest once they are needed.
struct Item {
  std::uint32_t slot, start, count;  // the group's (loaded)
  std::uint32_t r;                   // the item's index inside its group
  const unsigned char* rec;          // the expert's record
  const unsigned char* w0;           // gate's (or down's) weights
  const unsigned char* w1;           // up's (gate_up)
  const std::uint32_t* entries;      // the chunk's first entry
  std::uint32_t r0;                  // the tile's first row
  std::uint32_t nvalid;              // the chunk's tokens
  std::uint32_t n;                   // staged and multiplied: nvalid rounded up to the step
  std::uint32_t tbl;                 // which token table holds its rows (0 or 1)
};

// What every item of a block shares.
struct Ctx {
  const DevLayout* L;
  const DevBuffers* b;
  std::uint16_t* h_pieces_out;
  std::uint32_t K, R, KT;     // row length, rows, k-stages
  std::uint32_t tiles, step;  // row tiles; the chunks' step
  unsigned char* ring;        // [S] weight stages, [S] piece stages, [S] float32 stages
  const void** src_row;       // [2][BN]: a token's float32 row, or (Pre) its pieces
  std::uint32_t* entry_of;    // [2][BN]
};

// One pass's block: the ring, the items, the k loop and the epilogue. GateUp: h <- act(gate x +
// bg, up x + bu); else y <- w * (down h + bd). Vec: every staged 16-byte piece aligned and whole
// (rows a multiple of 8 columns), so cp.async stages them; else plain loads do, element by
// element (odd widths), and split x as they go. Pre (Vec only): the pieces come from b.x_pieces
// (gate_up) or b.h_pieces (down). Pieces: the activation pieces multiplied (3; 1 for gate_up
// over an x of bf16 values, pieces.cuh's x_is_bf16), staged in the three pieces' layout.
template <class T, bool GateUp, bool Vec, bool Pre, int Pieces>
struct Pass {
  static_assert(Pieces == kPieces || (Pieces == 1 && Pre), "one piece: staged pieces only");
  static constexpr int Mats = GateUp ? 2 : 1;
  static constexpr bool XRing = Vec && !Pre;
  using M = Smem<T, Mats, XRing>;
  static constexpr int S = M::S, P = S - 2;  // ring depth; stages loaded ahead
  static constexpr int BN = T::BN, kThreads = T::kThreads;
  static_assert(BN <= kThreads, "a thread a token of the tables");

  __device__ static void resolve(const Ctx& c, Item& it) {
    const DevLayout& L = *c.L;
    const DevBuffers& b = *c.b;
    const std::uint32_t size = chunk_size(it.count, BN, c.step);
    const std::uint32_t chunks = (it.count + size - 1) / size;
    const std::uint32_t chunk = it.r % chunks, t0 = chunk * size;
    it.r0 = it.r / chunks * T::BM;
    it.rec = b.arena + std::uint64_t(it.slot) * b.slot_bytes;
    it.w0 = it.rec + (GateUp ? L.m[0] : L.m[2]).weight;
    it.w1 = GateUp ? it.rec + L.m[1].weight : it.w0;
    it.entries = b.group_entries + it.start + t0;
    it.nvalid = it.count - t0 < size ? it.count - t0 : size;
    it.n = (it.nvalid + c.step - 1) / c.step * c.step;
  }

  // Token t's row of the item's table from its entry (t past the chunk: the first token's).
  __device__ static void set_row(const Ctx& c, std::uint32_t tbl, int t, std::uint32_t e) {
    const DevBuffers& b = *c.b;
    c.entry_of[tbl * BN + t] = e;
    const std::size_t row = GateUp ? e / c.L->top_k : e;
    if constexpr (Pre)
      c.src_row[tbl * BN + t] = (GateUp ? b.x_pieces : b.h_pieces) + row * 3 * c.K;
    else
      c.src_row[tbl * BN + t] = (GateUp ? b.x : b.h) + row * c.K;
  }
  __device__ static void fill_table(const Ctx& c, const Item& it) {
    for (int t = threadIdx.x; t < BN; t += kThreads)
      set_row(c, it.tbl, t, it.entries[std::uint32_t(t) < it.nvalid ? t : 0]);
  }

  // Stage kt of the item into ring slot `slot`: the tile's weight rows (zero past the matrix)
  // and the chunk's activations (zero past its tokens and the row's end).
  __device__ static void stage(const Ctx& c, const Item& it, std::uint32_t kt, std::uint32_t slot) {
    if (kt >= c.KT) return;
    const int tid = threadIdx.x;
    const std::uint32_t K = c.K, R = c.R, k0 = kt * BK, r0 = it.r0, n = it.n, nvalid = it.nvalid;
    unsigned char* A = c.ring + slot * M::a;
    unsigned char* Pc = c.ring + S * M::a + slot * M::p;
    const void* const* rows = c.src_row + it.tbl * BN;
    if constexpr (Vec) {
#pragma unroll 1
      for (int i = tid; i < Mats * T::BM * 8; i += kThreads) {
        const int q = i >> 3, col = (i & 7) * 8;
        const std::uint32_t r = r0 + q % T::BM;
        const bool in = r < R && k0 + col < K;
        const unsigned char* w = q < T::BM ? it.w0 : it.w1;
        cp_async16(A + swizzled(q, col), w + (in ? (std::size_t(r) * K + k0 + col) * 2 : 0), in);
      }
      if constexpr (Pre) {
#pragma unroll 1
        for (int piece = 0; piece < Pieces; ++piece)
#pragma unroll 1
          for (int i = tid; i < int(n) * 8; i += kThreads) {
            const int t = i >> 3, col = (i & 7) * 8;
            const bool in = std::uint32_t(t) < nvalid && k0 + col < K;
            const auto* src = static_cast<const std::uint16_t*>(rows[t]);
            cp_async16(Pc + swizzled(piece * BN + t, col),
                       src + (in ? std::size_t(piece) * K + k0 + col : 0), in);
          }
      } else {
        float* X = reinterpret_cast<float*>(c.ring + S * (M::a + M::p) + slot * M::x);
        for (int i = tid; i < int(n) * 8; i += kThreads) {
          const int t = i >> 3, col = (i & 7) * 8;
          const bool in = std::uint32_t(t) < nvalid && k0 + col < K;
          const float* src = static_cast<const float*>(rows[t]) + (in ? k0 + col : 0);
          cp_async16(X + t * BK + col, src, in);
          cp_async16(X + t * BK + col + 4, src + 4, in);
        }
      }
    } else {
      for (int e = tid; e < Mats * T::BM * BK; e += kThreads) {
        const int q = e / BK, col = e % BK;
        const std::uint32_t r = r0 + q % T::BM, kc = k0 + col;
        const unsigned char* w = q < T::BM ? it.w0 : it.w1;
        *reinterpret_cast<std::uint16_t*>(A + swizzled(q, col & ~7) + (col & 7) * 2) =
            r < R && kc < K ? load_u16(w + (std::size_t(r) * K + kc) * 2) : std::uint16_t(0);
      }
      for (int e = tid; e < int(n) * BK; e += kThreads) {
        const int t = e / BK, col = e % BK;
        const std::uint32_t kc = k0 + col;
        const float v = std::uint32_t(t) < nvalid && kc < K
                            ? static_cast<const float*>(rows[t])[kc]
                            : 0.0f;
        std::uint16_t p[3];
        pieces_of(v, p);
#pragma unroll
        for (int piece = 0; piece < kPieces; ++piece)
          *reinterpret_cast<std::uint16_t*>(Pc + swizzled(piece * BN + t, col & ~7) +
                                            (col & 7) * 2) = p[piece];
      }
    }
  }

  // XRing: the float32 rows this thread copied for the stage in `slot` -> their pieces (each
  // thread splits exactly what it copied, so its own cp.async wait suffices).
  __device__ static void split_stage(const Ctx& c, const Item& it, std::uint32_t slot) {
    const float* X = reinterpret_cast<const float*>(c.ring + S * (M::a + M::p) + slot * M::x);
    unsigned char* Pc = c.ring + S * M::a + slot * M::p;
    for (int i = threadIdx.x; i < int(it.n) * 8; i += kThreads) {
      const int t = i >> 3, col = (i & 7) * 8;
      const float4 v0 = *reinterpret_cast<const float4*>(X + t * BK + col);
      const float4 v1 = *reinterpret_cast<const float4*>(X + t * BK + col + 4);
      const float xs[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
      std::uint16_t p[3][8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        std::uint16_t q[3];
        pieces_of(xs[j], q);
        p[0][j] = q[0], p[1][j] = q[1], p[2][j] = q[2];
      }
#pragma unroll
      for (int piece = 0; piece < kPieces; ++piece) {
        const uint4 packed{std::uint32_t(p[piece][0]) | std::uint32_t(p[piece][1]) << 16,
                           std::uint32_t(p[piece][2]) | std::uint32_t(p[piece][3]) << 16,
                           std::uint32_t(p[piece][4]) | std::uint32_t(p[piece][5]) << 16,
                           std::uint32_t(p[piece][6]) | std::uint32_t(p[piece][7]) << 16};
        *reinterpret_cast<uint4*>(Pc + swizzled(piece * BN + t, col)) = packed;
      }
    }
  }

  // The item's k loop and epilogue, NT its tokens rounded up to the step. Its stages are
  // global stages s0, s0 + 1, ... of the block's ring, whose first P were issued already (by the
  // item before it when `cross`, else by the caller). Each iteration issues the stage P ahead:
  // this item's, or with `cross` the next item's first ones, whose token table it fills in
  // time (its entries loaded at iteration 1, stored before the barrier that precedes their first
  // use).
  template <int NT>
  __device__ static void run(const Ctx& c, const Item& cur, Item& next, bool has_next,
                             bool cross, std::uint32_t s0) {
    const DevLayout& L = *c.L;
    const DevBuffers& b = *c.b;
    const std::uint32_t KT = c.KT, R = c.R, nvalid = cur.nvalid;
    const int tid = threadIdx.x, wg = tid / 128;
    const bool ahead = cross && has_next;
    // Not zeroed: each chain's first wgmma (k-block 0) writes its accumulators without adding
    // them (wgmma_ops.cuh says why), which is the MMA of zeroed ones but for the sign of a zero.
    float hi[Mats][NT / 2];
    float rest[Mats][Pieces > 1 ? NT / 2 : 1];
    auto hold = [&] {
#pragma unroll
      for (int mat = 0; mat < Mats; ++mat) {
        wgmma_hold<NT / 2>(hi[mat]);
        if constexpr (Pieces > 1) wgmma_hold<NT / 2>(rest[mat]);
      }
    };
    std::uint32_t e_next = 0;
    for (std::uint32_t kt = 0; kt < KT; ++kt) {
      const std::uint32_t slot = (s0 + kt) % S, ahead_slot = (s0 + kt + P) % S;
      cp_async_wait<P - 1>();  // this thread's copies of stage kt landed
      if constexpr (XRing) split_stage(c, cur, slot);
      fence_proxy_async();  // generic-proxy writes (cp.async, the split) before wgmma reads
      // Stage kt landed for every thread, and every warpgroup is done with the stage two
      // before, whose slot the copies below overwrite.
      __syncthreads();
      if (kt + P < KT)
        stage(c, cur, kt + P, ahead_slot);
      else if (ahead)
        stage(c, next, kt + P - KT, ahead_slot);
      cp_async_commit();
      if (ahead) {
        if (kt == 1) {
          resolve(c, next);
          if (tid < BN) e_next = next.entries[std::uint32_t(tid) < next.nvalid ? tid : 0];
        }
        if (kt + P + 1 == KT && tid < BN) set_row(c, next.tbl, tid, e_next);
      }
      const std::uint32_t a_base = shared_addr(c.ring + slot * M::a) + wg * 64 * kRowBytes;
      const std::uint32_t p_base = shared_addr(c.ring + S * M::a + slot * M::p);
      hold();
      wgmma_arrive();
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) {
        const std::uint32_t acc = kt != 0 || kk != 0;  // 0: the chains' first k-block
#pragma unroll
        for (int mat = 0; mat < Mats; ++mat) {
          const std::uint64_t da = wgmma_desc(a_base + mat * T::BM * kRowBytes + kk * 32);
          wgmma_bf16<NT>(hi[mat], da, wgmma_desc(p_base + kk * 32), acc);
          if constexpr (Pieces == 3) {
            wgmma_bf16<NT>(rest[mat], da, wgmma_desc(p_base + BN * kRowBytes + kk * 32), acc);
            wgmma_bf16<NT>(rest[mat], da, wgmma_desc(p_base + 2 * BN * kRowBytes + kk * 32), 1);
          }
        }
      }
      wgmma_commit();
      wgmma_wait<1>();  // stage kt - 1's wgmmas done: its slot is free after the next barrier
      hold();
    }
    wgmma_wait<0>();
    hold();

    // The accumulators' layout (m64nN): element i of thread l of warp w (in its warpgroup) is
    // row 16 w + l / 4 (+8 for i % 4 >= 2), token 8 (i / 4) + 2 (l % 4) + i % 2.
    const std::uint32_t* entry_of = c.entry_of + cur.tbl * BN;
    const int lane = tid % 32, warp = tid / 32 % 4;
#pragma unroll
    for (int i = 0; i < NT / 2; ++i) {
      const std::uint32_t r = cur.r0 + wg * 64 + warp * 16 + lane / 4 + (i % 4) / 2 * 8;
      const std::uint32_t t = i / 4 * 8 + 2 * (lane % 4) + i % 2;
      if (r >= R || t >= nvalid) continue;
      const std::uint32_t e = entry_of[t];
      // + 0.0f: a zero sum +0 whatever its pieces' signs (the one piece's bits: pieces.cuh;
      // and mma.sync's, whose chains start from +0 where these start from their first product).
      float d0 = hi[0][i];
      if constexpr (Pieces > 1) d0 = d0 + rest[0][i];
      d0 = __fadd_rn(d0, 0.0f);
      if constexpr (GateUp) {
        float d1 = hi[Mats - 1][i];
        if constexpr (Pieces > 1) d1 = d1 + rest[Mats - 1][i];
        d1 = __fadd_rn(d1, 0.0f);
        float h = activate_swiglu(L, d0 + bias_at(L, L.m[0], cur.rec, r),
                                  d1 + bias_at(L, L.m[1], cur.rec, r));
#if STRATA_CUDA_PLANT  // tests only (device_types.h)
        if ((L.plant & kPlantGateUp) && r == 0) h += 1.0f / 1024.0f;
#endif
        b.h[std::size_t(e) * R + r] = h;
        if (c.h_pieces_out) {
          std::uint16_t p[3];
          split3(h, p[0], p[1], p[2]);
#pragma unroll
          for (int piece = 0; piece < 3; ++piece)
            c.h_pieces_out[(std::size_t(e) * 3 + piece) * R + r] = p[piece];
        }
      } else {
        b.y[std::size_t(e) * R + r] = b.weights[e] * (d0 + bias_at(L, L.m[2], cur.rec, r));
      }
    }
  }

  // The item's instance: its tokens rounded up to the step (one N for odd widths: the whole BN).
  template <int NT = (Vec ? T::STEP : T::BN)>
  __device__ static void run_n(const Ctx& c, const Item& cur, Item& next, bool has_next,
                               bool cross, std::uint32_t s0) {
    if constexpr (NT < BN) {
      if (cur.n > std::uint32_t(NT)) return run_n<NT + T::STEP>(c, cur, next, has_next, cross, s0);
    }
    run<NT>(c, cur, next, has_next, cross, s0);
  }
};

// A persistent grid: block i takes work items i, i + gridDim.x, ... of the pass, an item being
// (group, row tile, chunk of the group's tokens), numbered group by group, in each group tile by
// tile and chunk by chunk (so the blocks running at once share weight tiles and chunks through
// the L2). No block waits on an empty item, however uneven the groups, and a block's ring runs
// on from one item into the next (where the rows are long enough), so an item's first stages
// load while the item before computes.
template <class T, bool GateUp, bool Vec, bool Pre, int Pieces>
__device__ __forceinline__ void wgmma_pass(const DevLayout& L, const DevBuffers& b,
                                           std::uint16_t* h_pieces_out, std::uint32_t n_groups) {
  static_assert(Vec || !Pre, "the pieces are staged by cp.async");
  using X = Pass<T, GateUp, Vec, Pre, Pieces>;
  using M = typename X::M;
  constexpr int BN = T::BN, kThreads = T::kThreads, S = X::S, P = X::P;
  extern __shared__ __align__(1024) unsigned char smem[];
  if (shared_addr(smem) & 1023) __trap();  // the swizzle needs it; never seen
  auto** src_row = reinterpret_cast<const void**>(smem + S * M::stage);
  auto* entry_of = reinterpret_cast<std::uint32_t*>(src_row + 2 * BN);
  auto* items_to = entry_of + 2 * BN;           // [kTableGroups]: items of groups 0 .. g
  auto* warp_sums = items_to + kTableGroups;    // [32]: the scan's

  const DevMatrix& m0 = GateUp ? L.m[0] : L.m[2];
  Ctx c;
  c.L = &L, c.b = &b, c.h_pieces_out = h_pieces_out;
  c.K = m0.cols, c.R = m0.rows;  // gate/up: H columns, I rows; down: I, H
  c.KT = (c.K + BK - 1) / BK;
  c.tiles = (c.R + T::BM - 1) / T::BM;
  c.step = Vec ? T::STEP : BN;
  c.ring = smem, c.src_row = src_row, c.entry_of = entry_of;
  const bool table = n_groups <= std::uint32_t(kTableGroups);
  const int tid = threadIdx.x;

  // The groups' items, summed (an inclusive scan: each thread a run of kPer groups, then the
  // warps, then the block).
  std::uint32_t total = 0;
  if (table) {
    constexpr int kPer = (kTableGroups + kThreads - 1) / kThreads;
    std::uint32_t run[kPer], sum = 0;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const std::uint32_t g = tid * kPer + i;
      sum += g < n_groups ? items_of(b.group_count[g], BN, c.step, c.tiles) : 0;
      run[i] = sum;
    }
    const int lane = tid % 32, warp = tid / 32;
    std::uint32_t incl = sum;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const std::uint32_t v = __shfl_up_sync(0xffffffffu, incl, d);
      if (lane >= d) incl += v;
    }
    if (lane == 31) warp_sums[warp] = incl;
    __syncthreads();
    std::uint32_t before = incl - sum;
    for (int w = 0; w < warp; ++w) before += warp_sums[w];
#pragma unroll
    for (int i = 0; i < kPer; ++i)
      if (tid * kPer + i < kTableGroups) items_to[tid * kPer + i] = before + run[i];
    __syncthreads();
    total = n_groups == 0 ? 0 : items_to[n_groups - 1];
  }
  // Item w's group and its loads (issued, not waited for). Beyond the table (more than
  // kTableGroups groups) every warp walks the groups' counts, 32 a step, forwards only, as the
  // items are (walk_g: the step's first group; walk_base: the items before it).
  std::uint32_t walk_g = 0, walk_base = 0;
  auto find = [&](std::uint32_t w, Item& it) {
    std::uint32_t g, base;
    if (table) {
      if (w >= total) return false;
      std::uint32_t lo = 0, hi = n_groups - 1;  // the first g with items_to[g] > w
      while (lo < hi) {
        const std::uint32_t mid = (lo + hi) / 2;
        if (items_to[mid] > w)
          hi = mid;
        else
          lo = mid + 1;
      }
      g = lo, base = g == 0 ? 0 : items_to[g - 1];
    } else {
      const int lane = tid % 32;
      for (;; walk_g += 32) {
        if (walk_g >= n_groups) return false;
        const std::uint32_t mine = walk_g + lane;
        const std::uint32_t n =
            mine < n_groups ? items_of(b.group_count[mine], BN, c.step, c.tiles) : 0;
        std::uint32_t incl = n;
#pragma unroll
        for (int d = 1; d < 32; d *= 2) {
          const std::uint32_t v = __shfl_up_sync(0xffffffffu, incl, d);
          if (lane >= d) incl += v;
        }
        const unsigned past = __ballot_sync(0xffffffffu, walk_base + incl > w);
        if (past != 0) {
          const int l = __ffs(past) - 1;
          g = walk_g + l, base = walk_base + __shfl_sync(0xffffffffu, incl - n, l);
          break;
        }
        walk_base += __shfl_sync(0xffffffffu, incl, 31);
      }
    }
    it.slot = b.group_slot[g], it.start = b.group_start[g], it.count = b.group_count[g];
    it.r = w - base;
    return true;
  };

  Item cur, next;
  std::uint32_t w = blockIdx.x;
  if (!find(w, cur)) return;
  X::resolve(c, cur);
  cur.tbl = 0;
  // The ring runs on across items when an item's rows are long enough for the next item's
  // table to be filled inside its k loop.
  const bool cross = Vec && c.KT >= std::uint32_t(P) + 2;
  std::uint32_t s0 = 0;
  for (bool first = true;; first = false) {
    const bool has_next = find(w + gridDim.x, next);
    next.tbl = cur.tbl ^ 1;
    if (first || !cross) {
      X::fill_table(c, cur);
      __syncthreads();
#pragma unroll
      for (int i = 0; i < P; ++i) {
        X::stage(c, cur, i, (s0 + i) % S);
        cp_async_commit();
      }
    }
    X::run_n(c, cur, next, has_next, cross, s0);
    s0 = (s0 + c.KT) % S;
    if (!has_next) break;
    if (!cross) X::resolve(c, next);
    cur = next;
    w += gridDim.x;
  }
  cp_async_wait<0>();  // the empty groups committed past the last stage
}

template <class T, bool GateUp, bool Vec, bool Pre>
__global__ void __launch_bounds__(T::kThreads, 1)
    wgmma_kernel(DevLayout L, DevBuffers b, std::uint16_t* h_pieces_out) {
  // x_rest read beside groups_n: one round trip before the block's first stage.
  const std::uint32_t n_groups = *b.groups_n;
  if constexpr (kMayTakeOnePiece<GateUp, Pre, kPieces>) {
    if (x_is_bf16(b)) return wgmma_pass<T, GateUp, Vec, Pre, 1>(L, b, h_pieces_out, n_groups);
  }
  wgmma_pass<T, GateUp, Vec, Pre, kPieces>(L, b, h_pieces_out, n_groups);
}

template <class T, bool GateUp, bool Vec, bool Pre>
cudaError_t launch_as(const DevLayout& L, const DevBuffers& b, std::uint32_t rows,
                      std::uint32_t groups, std::uint16_t* h_pieces_out, cudaStream_t s) {
  constexpr std::size_t smem = Smem<T, GateUp ? 2 : 1, Vec && !Pre>::bytes;
  static const cudaError_t prepared =
      cudaFuncSetAttribute(wgmma_kernel<T, GateUp, Vec, Pre>,
                           cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (prepared != cudaSuccess) return prepared;
  // As many blocks as run at once (the items are spread over them), no more than the items.
  static const int resident = [] {
    int sms = 0, per_sm = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, wgmma_kernel<T, GateUp, Vec, Pre>,
                                                      T::kThreads, smem) != cudaSuccess) {
      cudaGetLastError();
      return 132;
    }
    return std::max(1, sms * per_sm);
  }();
  const std::uint32_t out_rows = GateUp ? L.inter : L.hidden;
  // A token routes to an expert once, so a pass has at most rows * top_k entries and no group
  // more than `rows`; a group of n has at most ceil(n / BN) chunks: at most this many items.
  const std::uint64_t chunks = std::min<std::uint64_t>(
      std::uint64_t(groups) * ((rows + T::BN - 1) / T::BN),
      (std::uint64_t(rows) * L.top_k + T::BN - 1) / T::BN + groups);
  const std::uint64_t items = chunks * ((out_rows + T::BM - 1) / T::BM);
  const unsigned grid = unsigned(std::min<std::uint64_t>(items, std::uint64_t(resident)));
  wgmma_kernel<T, GateUp, Vec, Pre><<<grid, T::kThreads, smem, s>>>(L, b, h_pieces_out);
  return cudaGetLastError();
}

// Without the pieces (no scratch, odd widths) a prompt takes the small tiling at every row
// count: its float32 staging fits beside the ring where the large tiling's would not.
template <class P, bool GateUp>
cudaError_t launch_prompt(const DevLayout& L, const DevBuffers& b, std::uint32_t rows,
                          std::uint32_t groups, bool vec, std::uint16_t* h_out, cudaStream_t s) {
  if (stages_pieces(L, b, rows, GateUp, kPromptPieces, kDecodeBelowRows))
    return launch_with_pieces<GateUp>(L, b, rows, s, [&] {
      return launch_as<P, GateUp, true, true>(L, b, rows, groups, h_out, s);
    });
  using Q = SmallTiling<GateUp>;
  return vec ? launch_as<Q, GateUp, true, false>(L, b, rows, groups, h_out, s)
             : launch_as<Q, GateUp, false, false>(L, b, rows, groups, h_out, s);
}

template <bool GateUp>
cudaError_t launch_wgmma(const DevLayout& L, const DevBuffers& b, std::uint32_t rows,
                       cudaStream_t s) {
  if (L.format != 2) return cudaErrorInvalidValue;
  const std::uint32_t n = rows * L.top_k;
  const std::uint32_t groups = n < L.n_experts ? n : L.n_experts;
  if (groups == 0) return cudaSuccess;
  const bool vec = vectorizable(L, b, GateUp);
  const bool down_pieces = stages_pieces(L, b, rows, false, kPromptPieces, kDecodeBelowRows);
  std::uint16_t* h_out = GateUp && down_pieces ? b.h_pieces : nullptr;
  if (rows < kDecodeBelowRows)
    return vec ? launch_as<DecodeTiling, GateUp, true, false>(L, b, rows, groups, h_out, s)
               : launch_as<DecodeTiling, GateUp, false, false>(L, b, rows, groups, h_out, s);
  if constexpr (kSmallBelowRows > kDecodeBelowRows) {
    if (rows < kSmallBelowRows)
      return launch_prompt<SmallTiling<GateUp>, GateUp>(L, b, rows, groups, vec, h_out, s);
  }
  return launch_prompt<PromptTiling<GateUp>, GateUp>(L, b, rows, groups, vec, h_out, s);
}

}  // namespace

std::string wgmma_unavailable() {
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
    cudaGetLastError();
    return "could not read the CUDA device's compute capability";
  }
  if (major != 9 || minor != 0)
    return "the wgmma kernels are Hopper machine code (sm_90a); this GPU has compute capability " +
           std::to_string(major) + "." + std::to_string(minor);
  // sm_90a code loads on 9.0 alone; a build without it (another CUDA_ARCHITECTURES) has none.
  cudaFuncAttributes a{};
  if (const cudaError_t e = cudaFuncGetAttributes(&a, split_rows_kernel); e != cudaSuccess) {
    cudaGetLastError();
    return std::string("this build has no wgmma kernels for this GPU: ") + cudaGetErrorString(e);
  }
  return "";
}

cudaError_t launch_gate_up_wgmma(const DevLayout& L, const DevBuffers& b, std::uint32_t rows,
                                 cudaStream_t s) {
  return launch_wgmma<true>(L, b, rows, s);
}

cudaError_t launch_down_wgmma(const DevLayout& L, const DevBuffers& b, std::uint32_t rows,
                              cudaStream_t s) {
  return launch_wgmma<false>(L, b, rows, s);
}

}  // namespace strata::cuda
