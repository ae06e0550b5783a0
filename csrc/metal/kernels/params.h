// The scalars every kernel receives (setBytes at buffer index 0) and the buffer binding table.
// Shared verbatim by the .metal sources and the C++ host, so the layout cannot drift: only
// fixed-width integers, 64-bit fields first (identical alignment in MSL and C++).
#pragma once

#ifdef __METAL_VERSION__
#define STRATA_U32 uint
#define STRATA_U64 ulong
#else
#include <cstdint>
#define STRATA_U32 std::uint32_t
#define STRATA_U64 std::uint64_t
#endif

#define STRATA_MAX_ARENA_VIEWS 8
#define STRATA_MAX_TOP_K 32

struct KernelParams {
  // Byte offsets of each matrix's weight/scales/biases inside an expert record.
  STRATA_U64 gate_w, gate_s, gate_b;
  STRATA_U64 up_w, up_s, up_b;
  STRATA_U64 down_w, down_s, down_b;
  // ... and of each matrix's Linear bias [rows] (gpt-oss), read when bias_format != 0.
  STRATA_U64 gate_bias, up_bias, down_bias;
  STRATA_U64 slot_bytes;       // record_stride: slot s starts at s * slot_bytes
  STRATA_U32 slots_per_view;   // arena view v holds slots [v * spv, (v + 1) * spv)
  STRATA_U32 n_slots;
  STRATA_U32 layer;
  STRATA_U32 rows;             // T tokens
  STRATA_U32 pass;             // 0 resident (plan snapshot), 1 missing (smap now)
  STRATA_U32 distance;         // RoutePredict: 1 or 2
  STRATA_U32 n_experts, top_k, hidden, inter;
  STRATA_U32 routing;          // 0 softmax_topk, 1 topk_softmax
  STRATA_U32 norm_topk_prob;
  STRATA_U32 wave_groups;      // MoeMM: threadgroup columns encoded (>= any *wave_n)
  STRATA_U32 bias_format;      // 0 no Linear biases, else 1 + (0 f32, 1 f16, 2 bf16)
  STRATA_U32 act_alpha_bits;   // swiglu_oai's alpha and limit, as float bit patterns
  STRATA_U32 act_limit_bits;
  STRATA_U32 pad_;
};

// Buffer indices, identical for every kernel (the host binds all of them once per encoder).
#define STRATA_BUF_PARAMS 0
#define STRATA_BUF_SMAP 1
#define STRATA_BUF_ROUTERS 2
#define STRATA_BUF_X 3
#define STRATA_BUF_IDS 4
#define STRATA_BUF_WEIGHTS 5
#define STRATA_BUF_PRED1 6
#define STRATA_BUF_PRED2 7
#define STRATA_BUF_LOGITS 8
#define STRATA_BUF_PLAN 9
#define STRATA_BUF_H 10
#define STRATA_BUF_Y 11
#define STRATA_BUF_OUT 12
#define STRATA_BUF_WAVE 13
#define STRATA_BUF_WAVE_N 14
#define STRATA_BUF_STATUS 15  // [0] error code, [1] its layer, [2] abort: skip all work
#define STRATA_BUF_ARENA0 16  // .. STRATA_BUF_ARENA0 + STRATA_MAX_ARENA_VIEWS - 1
#define STRATA_BUF_COUNT (STRATA_BUF_ARENA0 + STRATA_MAX_ARENA_VIEWS)

#define STRATA_STATUS_ERROR 0
#define STRATA_STATUS_LAYER 1
#define STRATA_STATUS_ABORT 2
#define STRATA_STATUS_WORDS 4
#define STRATA_ERROR_ABSENT 1u  // a pass's expert has no published slot (handshake bug)
