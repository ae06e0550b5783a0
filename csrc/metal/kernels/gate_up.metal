// gate_up: h[i] = act(gate x_t, up x_t) for the entries i = t * top_k + j of one decode pass.
// Grid (ceil(inter / 8), rows * top_k); threadgroup (32, 2): simdgroup sg owns 4 rows of both
// gate and up, so each x block is loaded once for 8 dot products.
#include "activation.h"
#include "matvec.h"

template <class Fmt, class Act>
[[kernel]] void gate_up(STRATA_KERNEL_PARAMS) {
  if (aborted(status)) return;
  const uint i = tg.y;
  if (i >= p.rows * p.top_k) return;
  uint slot = 0;
  const EntryClass c = pass_entry(p, smap, plan, ids, i, slot);
  if (c == kEntrySkip) return;
  if (c == kEntryBroken) {
    report_absent(status, p.layer);
    return;
  }
  const ArenaViews av = STRATA_ARENA_VIEWS;
  device const uchar* rec = record_bytes(p, av, slot);
  const MatrixRef m[2] = {matrix_at(rec, p.gate_w, p.gate_s, p.gate_b, p.hidden),
                          matrix_at(rec, p.up_w, p.up_s, p.up_b, p.hidden)};
  const uint row0 = tg.x * kRowsPerGroup + sg * kRowsPerSimd;
  float res[2 * kRowsPerSimd];
  dot_rows<Fmt, 2>(m, row0, p.inter, x + ulong(i / p.top_k) * p.hidden, p.hidden, lane, res);
  const uint r = row0 + lane;
  if (lane < kRowsPerSimd && r < p.inter) {
    const float g = add_bias(p, rec, p.gate_bias, r, res[lane]);
    const float u = add_bias(p, rec, p.up_bias, r, res[kRowsPerSimd + lane]);
    h[ulong(i) * p.inter + r] = Act::apply(p, g, u);
  }
}

// A format type may hold commas (Q4Format<64, ScaleF16>): it travels as __VA_ARGS__.
#define STRATA_GATE_UP_ACT(fmt_name, act_name, Act, ...) \
  STRATA_KERNEL("gate_up_" fmt_name "_" act_name, gate_up, __VA_ARGS__, Act)
#define STRATA_GATE_UP(fmt_name, ...) \
  STRATA_FOR_EACH_ACTIVATION(STRATA_GATE_UP_ACT, fmt_name, __VA_ARGS__)
STRATA_FOR_EACH_FORMAT(STRATA_GATE_UP)
