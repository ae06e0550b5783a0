// What every kernel shares: the MSL (or shim) environment, one uniform kernel signature, the
// instantiation macro, and the two rules for finding an expert's bytes:
//  - an expert is resolved only through smap (missing pass, prompt waves) or the plan's
//    snapshot of smap (resident pass), never through anything the host encoded;
//  - an entry whose slot is absent is a handshake bug: it is reported in the status buffer and
//    its outputs are left alone, never computed from stale bytes.
#pragma once

#ifdef __METAL_VERSION__
#include <metal_stdlib>
using namespace metal;
#else
// Off Metal the kernels are C++ for the test equipment in tests/metal/shim (the emulator and
// the address-space type-check), whose builds put that folder on the include path.
#ifndef STRATA_MSL_TYPECHECK
#include "msl_runtime.h"  // before the prelude: it includes std headers
#endif
#include "msl_prelude.h"
#endif

#include "params.h"

#define STRATA_ABSENT 0xFFFFFFFFu

// One signature for every kernel: the host binds the same table to each dispatch, and the
// Linux emulator calls every kernel through one function-pointer type.
#define STRATA_KERNEL_PARAMS                                                        \
  constant KernelParams& p [[buffer(STRATA_BUF_PARAMS)]],                           \
      device const uint* smap [[buffer(STRATA_BUF_SMAP)]],                          \
      device const float* routers [[buffer(STRATA_BUF_ROUTERS)]],                   \
      device const float* x [[buffer(STRATA_BUF_X)]],                               \
      device int* ids [[buffer(STRATA_BUF_IDS)]],                                   \
      device float* weights [[buffer(STRATA_BUF_WEIGHTS)]],                         \
      device int* pred1 [[buffer(STRATA_BUF_PRED1)]],                               \
      device int* pred2 [[buffer(STRATA_BUF_PRED2)]],                               \
      device float* logits [[buffer(STRATA_BUF_LOGITS)]],                           \
      device uint* plan [[buffer(STRATA_BUF_PLAN)]],                                \
      device float* h [[buffer(STRATA_BUF_H)]],                                     \
      device float* y [[buffer(STRATA_BUF_Y)]],                                     \
      device float* out [[buffer(STRATA_BUF_OUT)]],                                 \
      device const int* wave [[buffer(STRATA_BUF_WAVE)]],                           \
      device const uint* wave_n [[buffer(STRATA_BUF_WAVE_N)]],                      \
      device atomic_uint* status [[buffer(STRATA_BUF_STATUS)]],                     \
      device const uchar* arena0 [[buffer(STRATA_BUF_ARENA0 + 0)]],                 \
      device const uchar* arena1 [[buffer(STRATA_BUF_ARENA0 + 1)]],                 \
      device const uchar* arena2 [[buffer(STRATA_BUF_ARENA0 + 2)]],                 \
      device const uchar* arena3 [[buffer(STRATA_BUF_ARENA0 + 3)]],                 \
      device const uchar* arena4 [[buffer(STRATA_BUF_ARENA0 + 4)]],                 \
      device const uchar* arena5 [[buffer(STRATA_BUF_ARENA0 + 5)]],                 \
      device const uchar* arena6 [[buffer(STRATA_BUF_ARENA0 + 6)]],                 \
      device const uchar* arena7 [[buffer(STRATA_BUF_ARENA0 + 7)]],                 \
      uint3 tg [[threadgroup_position_in_grid]],                                    \
      uint3 tpos [[thread_position_in_threadgroup]],                                \
      uint lane [[thread_index_in_simdgroup]],                                      \
      uint sg [[simdgroup_index_in_threadgroup]]

#define STRATA_CAT2(a, b) a##b
#define STRATA_CAT(a, b) STRATA_CAT2(a, b)

// Instantiates fn<template args...> under the Metal function name `name`. On Metal this is the
// explicit instantiation MSL requires; the type-check instantiates the same body (C++ has no
// attribute slot there, so host_name is dropped); the emulator registers the function by name.
#if defined(__METAL_VERSION__)
#define STRATA_KERNEL(name, fn, ...) \
  template [[host_name(name)]] [[kernel]] void fn<__VA_ARGS__>(STRATA_KERNEL_PARAMS);
#elif defined(STRATA_MSL_TYPECHECK)
#define STRATA_KERNEL(name, fn, ...) template void fn<__VA_ARGS__>(STRATA_KERNEL_PARAMS);
#else
#define STRATA_KERNEL(name, fn, ...)                                              \
  static const bool STRATA_CAT(strata_registered_, __COUNTER__) =                 \
      strata_shim::register_kernel(name, &fn<__VA_ARGS__>);
#endif

// A kernel's view of the expert arena: up to STRATA_MAX_ARENA_VIEWS buffers, each a whole
// number of slots (slot_bytes is a multiple of the 16 KiB page, so views never split a record).
struct ArenaViews {
  device const uchar* view[STRATA_MAX_ARENA_VIEWS];
};

#define STRATA_ARENA_VIEWS \
  ArenaViews { { arena0, arena1, arena2, arena3, arena4, arena5, arena6, arena7 } }

inline device const uchar* record_bytes(constant KernelParams& p, thread const ArenaViews& a,
                                        uint slot) {
  const uint v = slot / p.slots_per_view;
  return a.view[v] + ulong(slot - v * p.slots_per_view) * p.slot_bytes;
}

// The host set the abort flag: every kernel returns at once so queued work drains quickly.
inline bool aborted(device atomic_uint* status) {
  return atomic_load_explicit(&status[STRATA_STATUS_ABORT], memory_order_relaxed) != 0u;
}

inline void report_absent(device atomic_uint* status, uint layer) {
  atomic_store_explicit(&status[STRATA_STATUS_LAYER], layer, memory_order_relaxed);
  atomic_store_explicit(&status[STRATA_STATUS_ERROR], STRATA_ERROR_ABSENT, memory_order_relaxed);
}

enum EntryClass : uint { kEntrySkip = 0, kEntryRun = 1, kEntryBroken = 2 };

// Entry i (= t * top_k + j) in a decode pass: is it this pass's, and from which slot. Resident
// entries use the slot the plan saw (I8 keeps it valid); missing ones read smap now (published
// by the second release). Uniform across a threadgroup: it depends on i only.
inline EntryClass pass_entry(constant KernelParams& p, device const uint* smap,
                             device const uint* plan, device const int* ids, uint i,
                             thread uint& slot) {
  const uint planned = plan[i];
  const bool resident = planned != STRATA_ABSENT;
  if (resident != (p.pass == 0u)) return kEntrySkip;
  slot = resident ? planned : smap[p.layer * p.n_experts + uint(ids[i])];
  return slot == STRATA_ABSENT || slot >= p.n_slots ? kEntryBroken : kEntryRun;
}
