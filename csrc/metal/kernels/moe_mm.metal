// moe_mm: a prompt wave, grouped by expert. Threadgroup column w takes expert wave[w] (the host
// writes wave and *wave_n after encoding, before it releases the wave, so columns past *wave_n
// return), resolves its slot through smap, and runs every routed entry of that expert, in entry
// order, through the same dot_rows as the decode passes: each (entry, row) gets exactly the bits
// gate_up/down would give it, whatever the arena size made this chunk a wave or a decode (I11).
// Two kernels, because down needs every row of h: moe_gate_up then moe_down, in one encoder.
#include "activation.h"
#include "matvec.h"

// Slot of wave column w, or false (nothing to do). Reports an absent slot.
inline bool wave_slot(constant KernelParams& p, device const uint* smap,
                      device const int* wave, device const uint* wave_n,
                      device atomic_uint* status, uint w, thread uint& expert,
                      thread uint& slot) {
  if (w >= wave_n[0]) return false;
  expert = uint(wave[w]);
  slot = smap[p.layer * p.n_experts + expert];
  if (slot == STRATA_ABSENT || slot >= p.n_slots) {
    report_absent(status, p.layer);
    return false;
  }
  return true;
}

template <class Fmt, class Act>
[[kernel]] void moe_gate_up(STRATA_KERNEL_PARAMS) {
  if (aborted(status)) return;
  uint expert = 0, slot = 0;
  if (!wave_slot(p, smap, wave, wave_n, status, tg.y, expert, slot)) return;
  const ArenaViews av = STRATA_ARENA_VIEWS;
  device const uchar* rec = record_bytes(p, av, slot);
  const MatrixRef m[2] = {matrix_at(rec, p.gate_w, p.gate_s, p.gate_b, p.hidden),
                          matrix_at(rec, p.up_w, p.up_s, p.up_b, p.hidden)};
  const uint row0 = tg.x * kRowsPerGroup + sg * kRowsPerSimd;
  for (uint i = 0; i < p.rows * p.top_k; ++i) {
    if (uint(ids[i]) != expert) continue;
    float res[2 * kRowsPerSimd];
    dot_rows<Fmt, 2>(m, row0, p.inter, x + ulong(i / p.top_k) * p.hidden, p.hidden, lane, res);
    const uint r = row0 + lane;
    if (lane < kRowsPerSimd && r < p.inter) {
      const float g = add_bias(p, rec, p.gate_bias, r, res[lane]);
      const float u = add_bias(p, rec, p.up_bias, r, res[kRowsPerSimd + lane]);
      h[ulong(i) * p.inter + r] = Act::apply(p, g, u);
    }
  }
}

template <class Fmt>
[[kernel]] void moe_down(STRATA_KERNEL_PARAMS) {
  if (aborted(status)) return;
  uint expert = 0, slot = 0;
  if (!wave_slot(p, smap, wave, wave_n, status, tg.y, expert, slot)) return;
  const ArenaViews av = STRATA_ARENA_VIEWS;
  device const uchar* rec = record_bytes(p, av, slot);
  const MatrixRef m[1] = {matrix_at(rec, p.down_w, p.down_s, p.down_b, p.inter)};
  const uint row0 = tg.x * kRowsPerGroup + sg * kRowsPerSimd;
  for (uint i = 0; i < p.rows * p.top_k; ++i) {
    if (uint(ids[i]) != expert) continue;
    float res[kRowsPerSimd];
    dot_rows<Fmt, 1>(m, row0, p.hidden, h + ulong(i) * p.inter, p.inter, lane, res);
    const uint r = row0 + lane;
    if (lane < kRowsPerSimd && r < p.hidden)
      y[ulong(i) * p.hidden + r] = weights[i] * add_bias(p, rec, p.down_bias, r, res[lane]);
  }
}

#define STRATA_MOE_GATE_UP_ACT(fmt_name, act_name, Act, ...) \
  STRATA_KERNEL("moe_gate_up_" fmt_name "_" act_name, moe_gate_up, __VA_ARGS__, Act)
#define STRATA_MOE_GATE_UP(fmt_name, ...) \
  STRATA_FOR_EACH_ACTIVATION(STRATA_MOE_GATE_UP_ACT, fmt_name, __VA_ARGS__)
#define STRATA_MOE_DOWN(fmt_name, ...) \
  STRATA_KERNEL("moe_down_" fmt_name, moe_down, __VA_ARGS__)
STRATA_FOR_EACH_FORMAT(STRATA_MOE_GATE_UP)
STRATA_FOR_EACH_FORMAT(STRATA_MOE_DOWN)
