// gate_up and down for the bf16 weight format on the tensor cores, at every row count (decode's
// one token too), so that a token's output is the same bits alone and in any batch (I11, issue
// 19's batch-size rule).
//
// Arithmetic. A bf16 weight is an exact bf16 value; each float32 activation (x for gate_up, h
// for down) is split exactly into three bf16 pieces, x = hi + mid + lo (mma.cuh), so every
// product w * piece is exact in float32 and only the order of the sums differs from the CPU
// backend. The order is one per output element, fixed by the row length alone: the weight
// matrix is the MMA's A operand (16 output rows), the tokens its B operand (8 a column block,
// zero-padded), k in blocks of 16 strictly in order, and in each k-block
//   hi_acc = mma(W, hi, hi_acc);  rest = mma(W, mid, rest);  rest = mma(W, lo, rest);
// then out = ((hi_acc + rest) + 0) + bias. Two accumulators, not one: `rest` is about 2^-8 of
// hi_acc, so its own rounding is negligible and hi_acc's is that of one bf16 GEMM's float32 sum
// (the tensor core's, fixed by the hardware). Where every value of x is a bf16 value (a bf16
// model's activations), its mid and lo pieces are zeros and gate_up multiplies hi alone: the
// same bits (pieces.cuh, x_is_bf16), a third of the MMAs and of the pieces staged. An element's
// MMA result depends only on its row of W, its token's column and its own accumulator, never on
// the other columns (padding columns are zeros), the tile, the grid, the chunk or the pass: the
// same bits at every arena size, split, wave and batch.
//
// A block computes a tile of output rows (for gate_up the same rows of gate and of up, so the
// activation fuses) over a chunk of up to BN of its group's tokens, looping over the group's
// chunks; the weight tile and the activations are staged through shared memory by cp.async,
// STAGES deep, and warps read their fragments with ldmatrix. Prompts (from 8 rows) stage the
// activations' bf16 pieces, split once a pass into device scratch (x by a small kernel before
// gate_up, h by gate_up itself as it writes h), so a k-stage is one barrier and no arithmetic
// beside the MMAs; decode (and a backend without the scratch, or odd widths) stages the float32
// rows and splits them in shared memory once a stage. Only the chunk's tokens (rounded up to a
// column block of 8) are staged and split, not the whole chunk's width.
//
// Decode (below 8 rows) takes small tiles (by default 64 output rows, one 8-token column block,
// 4 warps) so that enough blocks stream the weights; prompts below 1024 rows take 128 (gate_up: of gate and of up) or 256 (down) rows by 32 tokens
// over 4 warps, from 1024 rows the same rows by 64 tokens over 8 warps (the knobs below). The
// tiling changes which thread computes an element, not its order.
#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "activation.cuh"
#include "pieces.cuh"
#include "mma.cuh"
#include "mma_experts.h"
#include "weights.cuh"

namespace strata::cuda {
namespace {

// Bench only (benchmarks/native/cuda_prompt_bench.cu builds it): x rounded to bf16 alone (one
// MMA a k-block, torch's arithmetic), to show what the exact split costs. Never in the backend.
#ifdef STRATA_CUDA_MMA_ONE_PIECE_BENCH
constexpr int kPieces = 1;
#else
constexpr int kPieces = 3;
#endif

template <int WM_, int WN_, int MT_, int NT_, int BK_, int STAGES_, int MIN_BLOCKS_ = 1>
struct Tiling {
  static constexpr int WM = WM_, WN = WN_;  // warps along output rows, along tokens
  static constexpr int MT = MT_, NT = NT_;  // a warp's 16-row tiles (per matrix), 8-token tiles
  static constexpr int BK = BK_, STAGES = STAGES_;
  static constexpr int kMinBlocks = MIN_BLOCKS_;  // __launch_bounds__' blocks a multiprocessor
  static constexpr int kThreads = 32 * WM * WN;
  static constexpr int BM = WM * MT * 16;  // output rows a block, per matrix
  static constexpr int BN = WN * NT * 8;   // tokens a chunk
  // A staged bf16 row: 16 bytes of padding, so that ldmatrix's 8 rows fall in distinct banks.
  static constexpr int kStride = BK + 8;
};

// Compile-time tuning knobs (tests/cuda/device_run.sh prompt builds neighbours of these, checks
// their outputs bitwise against the defaults' and times them): decode's warps a block (each 16
// output rows of gate and up, or of down), k-stage width and depth; the prompt tiling's warps
// along the tokens (64 tokens a chunk with 2, 32 with 1), k-stage width and depth, and those
// below. The defaults are the fastest benchmarks/cuda_prompt.py measured. None changes an
// output bit.
#ifndef STRATA_CUDA_MMA_DECODE_WARPS
#define STRATA_CUDA_MMA_DECODE_WARPS 4
#endif
#ifndef STRATA_CUDA_MMA_DECODE_BK
#define STRATA_CUDA_MMA_DECODE_BK 64
#endif
#ifndef STRATA_CUDA_MMA_DECODE_STAGES
#define STRATA_CUDA_MMA_DECODE_STAGES 4
#endif
#ifndef STRATA_CUDA_MMA_PROMPT_TOKEN_WARPS
#define STRATA_CUDA_MMA_PROMPT_TOKEN_WARPS 2
#endif
#ifndef STRATA_CUDA_MMA_PROMPT_BK
#define STRATA_CUDA_MMA_PROMPT_BK 32
#endif
#ifndef STRATA_CUDA_MMA_PROMPT_STAGES
#define STRATA_CUDA_MMA_PROMPT_STAGES 4
#endif
// The prompt tiling's warps along the output rows (each 2 tiles of 16 rows of gate and of up, or
// 4 of down), 8-token tiles a warp, the blocks a multiprocessor its registers are bounded for,
// and whether it stages the pieces from the scratch (1) or splits float32 rows itself (0).
#ifndef STRATA_CUDA_MMA_PROMPT_ROW_WARPS
#define STRATA_CUDA_MMA_PROMPT_ROW_WARPS 4
#endif
#ifndef STRATA_CUDA_MMA_PROMPT_TOKEN_TILES
#define STRATA_CUDA_MMA_PROMPT_TOKEN_TILES 4
#endif
#ifndef STRATA_CUDA_MMA_PROMPT_MIN_BLOCKS
#define STRATA_CUDA_MMA_PROMPT_MIN_BLOCKS 1
#endif
#ifndef STRATA_CUDA_MMA_PROMPT_PIECES
#define STRATA_CUDA_MMA_PROMPT_PIECES 1
#endif
// Prompts below this many rows (0: none) take a second tiling, with its own warps along the
// rows and along the tokens (the other knobs as the prompt tiling's): few tokens a group want
// taller tiles and narrower chunks.
#ifndef STRATA_CUDA_MMA_SMALL_BELOW_ROWS
#define STRATA_CUDA_MMA_SMALL_BELOW_ROWS 1024
#endif
#ifndef STRATA_CUDA_MMA_SMALL_ROW_WARPS
#define STRATA_CUDA_MMA_SMALL_ROW_WARPS 4
#endif
#ifndef STRATA_CUDA_MMA_SMALL_TOKEN_WARPS
#define STRATA_CUDA_MMA_SMALL_TOKEN_WARPS 1
#endif
static_assert(STRATA_CUDA_MMA_DECODE_BK % 16 == 0 && STRATA_CUDA_MMA_PROMPT_BK % 16 == 0,
              "k-stages hold whole k-blocks of 16");
static_assert(STRATA_CUDA_MMA_DECODE_STAGES >= 2 && STRATA_CUDA_MMA_PROMPT_STAGES >= 2,
              "the ring needs two stages at least");

using DecodeTiling = Tiling<STRATA_CUDA_MMA_DECODE_WARPS, 1, 1, 1, STRATA_CUDA_MMA_DECODE_BK,
                            STRATA_CUDA_MMA_DECODE_STAGES>;
template <bool GateUp>
using PromptTiling = Tiling<STRATA_CUDA_MMA_PROMPT_ROW_WARPS, STRATA_CUDA_MMA_PROMPT_TOKEN_WARPS,
                            GateUp ? 2 : 4, STRATA_CUDA_MMA_PROMPT_TOKEN_TILES,
                            STRATA_CUDA_MMA_PROMPT_BK, STRATA_CUDA_MMA_PROMPT_STAGES,
                            STRATA_CUDA_MMA_PROMPT_MIN_BLOCKS>;
template <bool GateUp>
using SmallTiling = Tiling<STRATA_CUDA_MMA_SMALL_ROW_WARPS, STRATA_CUDA_MMA_SMALL_TOKEN_WARPS,
                           GateUp ? 2 : 4, STRATA_CUDA_MMA_PROMPT_TOKEN_TILES,
                           STRATA_CUDA_MMA_PROMPT_BK, STRATA_CUDA_MMA_PROMPT_STAGES,
                           STRATA_CUDA_MMA_PROMPT_MIN_BLOCKS>;
constexpr bool kPromptPieces = STRATA_CUDA_MMA_PROMPT_PIECES != 0;
constexpr std::uint32_t kSmallBelowRows = STRATA_CUDA_MMA_SMALL_BELOW_ROWS;

// Rows below this take the decode tiling (experts.cu's kDirectBelowRows, the same boundary).
constexpr std::uint32_t kDecodeBelowRows = 8;
// At most this many blocks share one (group, row tile), each taking every such chunk in turn.
constexpr std::uint32_t kMaxChunkSlots = 8;

template <class T, int Mats>
__host__ __device__ constexpr std::size_t a_bytes() {
  return std::size_t(T::STAGES) * Mats * T::BM * T::kStride * 2;
}
// Pre: the staged pieces ([S][kPieces][BN][KS] bf16), the only activation buffer. Else the
// float32 rows ([S][BN][BK]) and one split stage ([kPieces][BN][KS]).
template <class T, bool Pre>
__host__ __device__ constexpr std::size_t x_bytes() {
  return Pre ? std::size_t(T::STAGES) * kPieces * T::BN * T::kStride * 2
             : std::size_t(T::STAGES) * T::BN * T::BK * 4 +
                   std::size_t(kPieces) * T::BN * T::kStride * 2;
}
template <class T, int Mats, bool Pre>
__host__ __device__ constexpr std::size_t smem_bytes() {
  return a_bytes<T, Mats>() + x_bytes<T, Pre>();
}

// GateUp: h <- act(gate x + bg, up x + bu); else y <- w * (down h + bd). Vec: every staged
// 16-byte piece is aligned and whole (rows a multiple of 8 columns), so cp.async stages them;
// else plain loads do, element by element (odd widths), with the same arithmetic after. Pre
// (Vec only): the activations' pieces come from b.x_pieces (gate_up) or b.h_pieces (down).
// h_pieces_out (gate_up): where to write h's pieces beside h, for a down that stages them; null
// for none. Pieces: the activation pieces multiplied (3; 1 for gate_up over an x of bf16 values,
// pieces.cuh's x_is_bf16), staged in the three pieces' layout. The block's group (blockIdx.z):
// its slot, its first entry and its entries.
template <class T, bool GateUp, bool Vec, bool Pre, int Pieces>
__device__ __forceinline__ void mma_pass(const DevLayout& L, const DevBuffers& b,
                                         std::uint16_t* h_pieces_out, std::uint32_t slot,
                                         std::uint32_t start, std::uint32_t count) {
  static_assert(Vec || !Pre, "the pieces are staged by cp.async");
  static_assert(Pieces == kPieces || (Pieces == 1 && Pre), "one piece: staged pieces only");
  constexpr int Mats = GateUp ? 2 : 1;
  constexpr int BM = T::BM, BN = T::BN, BK = T::BK, S = T::STAGES, KS = T::kStride;
  constexpr int MT = T::MT, NT = T::NT;
  const DevMatrix& m0 = GateUp ? L.m[0] : L.m[2];
  const std::uint32_t K = m0.cols, R = m0.rows;  // gate/up: H columns, I rows; down: I, H
  const std::uint32_t r0 = blockIdx.y * BM;
  const unsigned char* rec = b.arena + std::uint64_t(slot) * b.slot_bytes;
  const unsigned char* w0 = rec + m0.weight;
  const unsigned char* w1 = GateUp ? rec + L.m[1].weight : w0;
  const std::uint32_t* entries = b.group_entries + start;

  extern __shared__ __align__(16) unsigned char smem[];
  auto* As = reinterpret_cast<std::uint16_t*>(smem);  // [S][Mats*BM][KS]
  // Pre: [S][pieces][BN][KS]. Else Xs [S][BN][BK] float32, then Ps [pieces][BN][KS].
  auto* Xs = reinterpret_cast<float*>(smem + a_bytes<T, Mats>());
  auto* Ps = reinterpret_cast<std::uint16_t*>(
      smem + a_bytes<T, Mats>() + (Pre ? 0 : std::size_t(S) * BN * BK * 4));
  __shared__ const void* src_row[BN];  // a token's float32 row, or (Pre) its pieces
  __shared__ std::uint32_t entry_of[BN];

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int wm = warp % T::WM, wn = warp / T::WM;
  const std::uint32_t KT = (K + BK - 1) / BK;
  const std::uint32_t chunks = (count + BN - 1) / BN;

  for (std::uint32_t chunk = blockIdx.x; chunk < chunks; chunk += gridDim.x) {
    const std::uint32_t t0 = chunk * BN;
    const std::uint32_t nvalid = count - t0 < std::uint32_t(BN) ? count - t0 : BN;
    // Tokens staged: the chunk's, up to whole column blocks of 8 (the rest is never read: a
    // column block past nvalid is skipped whole).
    const int nstaged = BN == 8 ? 8 : int((nvalid + 7) & ~7u);  // nvalid <= BN, BN % 8 == 0
    __syncthreads();  // the previous chunk's last reads of the staging and of entry_of
    for (int t = tid; t < BN; t += T::kThreads) {
      const std::uint32_t i = entries[t0 + (std::uint32_t(t) < nvalid ? t : 0)];
      entry_of[t] = i;
      const std::size_t row = GateUp ? i / L.top_k : i;
      if constexpr (Pre)
        src_row[t] = (GateUp ? b.x_pieces : b.h_pieces) + row * 3 * K;
      else
        src_row[t] = (GateUp ? b.x : b.h) + row * K;
    }
    __syncthreads();

    // Stage kt of the k loop into its ring buffer: the tile's weight rows (zero past the matrix)
    // and the chunk's activation rows (zero past the chunk's tokens and the row's end).
    auto stage = [&](std::uint32_t kt) {
      if (kt >= KT) return;
      const std::uint32_t k0 = kt * BK;
      std::uint16_t* A = As + (kt % S) * (Mats * BM * KS);
      float* X = Xs + (kt % S) * (BN * BK);
      if constexpr (Vec) {
        for (int c = tid; c < Mats * BM * BK / 8; c += T::kThreads) {
          const int q = c / (BK / 8), col = c % (BK / 8) * 8;
          const std::uint32_t r = r0 + q % BM;
          const bool in = r < R && k0 + col < K;
          const unsigned char* w = q < BM ? w0 : w1;
          cp_async16(A + q * KS + col, w + (in ? (std::size_t(r) * K + k0 + col) * 2 : 0), in);
        }
        if constexpr (Pre) {
          std::uint16_t* P = Ps + (kt % S) * (kPieces * BN * KS);
          for (int c = tid; c < Pieces * BN * BK / 8; c += T::kThreads) {
            const int q = c / (BK / 8), col = c % (BK / 8) * 8;
            const int piece = q / BN, t = q % BN;
            if (t >= nstaged) continue;
            const bool in = std::uint32_t(t) < nvalid && k0 + col < K;
            const auto* src = static_cast<const std::uint16_t*>(src_row[t]);
            cp_async16(P + q * KS + col, src + (in ? std::size_t(piece) * K + k0 + col : 0), in);
          }
        } else {
          for (int c = tid; c < nstaged * BK / 4; c += T::kThreads) {
            const int t = c / (BK / 4), col = c % (BK / 4) * 4;
            const bool in = std::uint32_t(t) < nvalid && k0 + col < K;
            const auto* src = static_cast<const float*>(src_row[t]);
            cp_async16(X + t * BK + col, src + (in ? k0 + col : 0), in);
          }
        }
      } else {
        for (int e = tid; e < Mats * BM * BK; e += T::kThreads) {
          const int q = e / BK, col = e % BK;
          const std::uint32_t r = r0 + q % BM, kc = k0 + col;
          const unsigned char* w = q < BM ? w0 : w1;
          A[q * KS + col] = r < R && kc < K ? load_u16(w + (std::size_t(r) * K + kc) * 2) : 0;
        }
        for (int e = tid; e < nstaged * BK; e += T::kThreads) {
          const int t = e / BK, col = e % BK;
          const std::uint32_t kc = k0 + col;
          X[t * BK + col] = std::uint32_t(t) < nvalid && kc < K
                                ? static_cast<const float*>(src_row[t])[kc]
                                : 0.0f;
        }
      }
    };

    float hi_acc[Mats][MT][NT][4] = {};
    float rest[Mats][MT][NT][Pieces > 1 ? 4 : 1] = {};
    for (int s = 0; s < S - 1; ++s) {
      stage(s);
      cp_async_commit();
    }
    for (std::uint32_t kt = 0; kt < KT; ++kt) {
      cp_async_wait<S - 2>();
      __syncthreads();  // stage kt landed for every thread; stage kt - 1's buffers are free
      stage(kt + S - 1);
      cp_async_commit();
      const std::uint16_t* P = Ps;
      if constexpr (Pre) {
        P = Ps + (kt % S) * (kPieces * BN * KS);
      } else {
      // The stage's activations, split into their bf16 pieces once for every warp.
      const float* X = Xs + (kt % S) * (BN * BK);
      for (int c = tid; c < nstaged * BK / 4; c += T::kThreads) {
        const int t = c / (BK / 4), col = c % (BK / 4) * 4;
        const float4 v = *reinterpret_cast<const float4*>(X + t * BK + col);
        const float xs[4] = {v.x, v.y, v.z, v.w};
        std::uint16_t p[3][4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          if constexpr (kPieces == 3) split3(xs[j], p[0][j], p[1][j], p[2][j]);
          else p[0][j] = bf16_rn(xs[j]);
        }
#pragma unroll
        for (int piece = 0; piece < kPieces; ++piece) {
          const uint2 packed{std::uint32_t(p[piece][0]) | std::uint32_t(p[piece][1]) << 16,
                             std::uint32_t(p[piece][2]) | std::uint32_t(p[piece][3]) << 16};
          *reinterpret_cast<uint2*>(Ps + (piece * BN + t) * KS + col) = packed;
        }
      }
      __syncthreads();
      }
      const std::uint16_t* A = As + (kt % S) * (Mats * BM * KS);
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) {
        std::uint32_t a[Mats][MT][4];
#pragma unroll
        for (int mat = 0; mat < Mats; ++mat)
#pragma unroll
          for (int mt = 0; mt < MT; ++mt)
            ldmatrix_x4(a[mat][mt],
                        A + (mat * BM + wm * MT * 16 + mt * 16 + lane % 16) * KS + kk * 16 +
                            lane / 16 * 8);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const int tok = wn * NT * 8 + nt * 8;
          if (std::uint32_t(tok) >= nvalid) continue;  // the whole warp: an all-padding tile
          const int row = tok + lane % 8, half = lane / 8 % 2 * 8;
          if constexpr (Pieces == 3) {
            std::uint32_t hm[4], lo[2];  // hi's two k-halves, then mid's; lo's
            ldmatrix_x4(hm, P + ((lane / 16) * BN + row) * KS + kk * 16 + half);
            ldmatrix_x2(lo, P + (2 * BN + row) * KS + kk * 16 + half);
#pragma unroll
            for (int mat = 0; mat < Mats; ++mat)
#pragma unroll
              for (int mt = 0; mt < MT; ++mt) {
                mma_bf16(hi_acc[mat][mt][nt], a[mat][mt], hm[0], hm[1]);
                mma_bf16(rest[mat][mt][nt], a[mat][mt], hm[2], hm[3]);
                mma_bf16(rest[mat][mt][nt], a[mat][mt], lo[0], lo[1]);
              }
          } else {
            std::uint32_t hi[2];
            ldmatrix_x2(hi, P + row * KS + kk * 16 + half);
#pragma unroll
            for (int mat = 0; mat < Mats; ++mat)
#pragma unroll
              for (int mt = 0; mt < MT; ++mt) mma_bf16(hi_acc[mat][mt][nt], a[mat][mt], hi[0], hi[1]);
          }
        }
      }
    }
    cp_async_wait<0>();

    // The accumulators' layout (m16n8): element e of lane l is row l/4 (+8 for e >= 2), token
    // 2 (l % 4) + e % 2 of the tile.
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const std::uint32_t r = r0 + wm * MT * 16 + mt * 16 + lane / 4 + e / 2 * 8;
          const std::uint32_t t = wn * NT * 8 + nt * 8 + 2 * (lane % 4) + e % 2;
          if (r >= R || t >= nvalid) continue;
          const std::uint32_t i = entry_of[t];
          // + 0.0f: a zero sum +0 whatever its pieces' signs (the one piece's bits: pieces.cuh).
          float d0 = hi_acc[0][mt][nt][e];
          if constexpr (Pieces > 1) d0 = d0 + rest[0][mt][nt][e];
          d0 = __fadd_rn(d0, 0.0f);
          if constexpr (GateUp) {
            float d1 = hi_acc[Mats - 1][mt][nt][e];
            if constexpr (Pieces > 1) d1 = d1 + rest[Mats - 1][mt][nt][e];
            d1 = __fadd_rn(d1, 0.0f);
            float h = activate_swiglu(L, d0 + bias_at(L, L.m[0], rec, r),
                                      d1 + bias_at(L, L.m[1], rec, r));
#if STRATA_CUDA_PLANT  // tests only (device_types.h)
            if ((L.plant & kPlantGateUp) && r == 0) h += 1.0f / 1024.0f;
#endif
            b.h[std::size_t(i) * R + r] = h;
            if (h_pieces_out) {
              std::uint16_t p[3];
              split3(h, p[0], p[1], p[2]);
#pragma unroll
              for (int piece = 0; piece < 3; ++piece)
                h_pieces_out[(std::size_t(i) * 3 + piece) * R + r] = p[piece];
            }
          } else {
            b.y[std::size_t(i) * R + r] = b.weights[i] * (d0 + bias_at(L, L.m[2], rec, r));
          }
        }
  }
}

template <class T, bool GateUp, bool Vec, bool Pre>
__global__ void __launch_bounds__(T::kThreads, T::kMinBlocks)
    mma_kernel(DevLayout L, DevBuffers b, std::uint16_t* h_pieces_out) {
  const std::uint32_t g = blockIdx.z;
  // Read before groups_n is known (g < n_experts keeps them in bounds), and x_rest beside them,
  // so the loads overlap.
  const std::uint32_t slot = b.group_slot[g], start = b.group_start[g], count = b.group_count[g];
  constexpr bool kMayTakeOne = kMayTakeOnePiece<GateUp, Pre, kPieces>;
  bool one = false;
  if constexpr (kMayTakeOne) one = x_is_bf16(b);
  if (g >= *b.groups_n) return;
  if constexpr (kMayTakeOne) {
    if (one) return mma_pass<T, GateUp, Vec, Pre, 1>(L, b, h_pieces_out, slot, start, count);
  }
  mma_pass<T, GateUp, Vec, Pre, kPieces>(L, b, h_pieces_out, slot, start, count);
}

template <class T, bool GateUp, bool Vec, bool Pre>
cudaError_t launch_as(const DevLayout& L, const DevBuffers& b, std::uint32_t rows,
                      std::uint32_t groups, std::uint16_t* h_pieces_out, cudaStream_t s) {
  constexpr std::size_t smem = smem_bytes<T, GateUp ? 2 : 1, Pre>();
  static const cudaError_t prepared =
      cudaFuncSetAttribute(mma_kernel<T, GateUp, Vec, Pre>,
                           cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (prepared != cudaSuccess) return prepared;
  const std::uint32_t out_rows = GateUp ? L.inter : L.hidden;
  // A token routes to an expert once, so no group has more than `rows` entries.
  const std::uint32_t slots = std::min<std::uint32_t>((rows + T::BN - 1) / T::BN, kMaxChunkSlots);
  const dim3 grid(slots, (out_rows + T::BM - 1) / T::BM, groups);
  mma_kernel<T, GateUp, Vec, Pre><<<grid, T::kThreads, smem, s>>>(L, b, h_pieces_out);
  return cudaGetLastError();
}

template <class P, bool GateUp>
cudaError_t launch_prompt(const DevLayout& L, const DevBuffers& b, std::uint32_t rows,
                          std::uint32_t groups, bool vec, std::uint16_t* h_out, cudaStream_t s) {
  if (stages_pieces(L, b, rows, GateUp, kPromptPieces, kDecodeBelowRows))
    return launch_with_pieces<GateUp>(L, b, rows, s, [&] {
      return launch_as<P, GateUp, true, true>(L, b, rows, groups, h_out, s);
    });
  return vec ? launch_as<P, GateUp, true, false>(L, b, rows, groups, h_out, s)
             : launch_as<P, GateUp, false, false>(L, b, rows, groups, h_out, s);
}

template <bool GateUp>
cudaError_t launch_mma(const DevLayout& L, const DevBuffers& b, std::uint32_t rows,
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
    if (rows < std::max(kSmallBelowRows, kDecodeBelowRows))
      return launch_prompt<SmallTiling<GateUp>, GateUp>(L, b, rows, groups, vec, h_out, s);
  }
  return launch_prompt<PromptTiling<GateUp>, GateUp>(L, b, rows, groups, vec, h_out, s);
}

}  // namespace

std::size_t mma_x_pieces_bytes(const DevLayout& L, std::uint32_t rows) {
  return L.format == 2 ? std::size_t(rows) * 3 * L.hidden * 2 : 0;
}
std::size_t mma_h_pieces_bytes(const DevLayout& L, std::uint32_t rows) {
  return L.format == 2 ? std::size_t(rows) * L.top_k * 3 * L.inter * 2 : 0;
}

cudaError_t launch_gate_up_mma(const DevLayout& L, const DevBuffers& b, std::uint32_t rows,
                               cudaStream_t s) {
  return launch_mma<true>(L, b, rows, s);
}

cudaError_t launch_down_mma(const DevLayout& L, const DevBuffers& b, std::uint32_t rows,
                            cudaStream_t s) {
  return launch_mma<false>(L, b, rows, s);
}

}  // namespace strata::cuda
