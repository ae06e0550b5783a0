// down: y[i] = w_i * (down h_i), the routing weight applied here so that combine is a plain,
// ordered sum. Grid (ceil(hidden / 8), rows * top_k); threadgroup (32, 2).
#include "activation.h"
#include "matvec.h"

template <class Fmt>
[[kernel]] void down(STRATA_KERNEL_PARAMS) {
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
  const MatrixRef m[1] = {matrix_at(rec, p.down_w, p.down_s, p.down_b, p.inter)};
  const uint row0 = tg.x * kRowsPerGroup + sg * kRowsPerSimd;
  float res[kRowsPerSimd];
  dot_rows<Fmt, 1>(m, row0, p.hidden, h + ulong(i) * p.inter, p.inter, lane, res);
  const uint r = row0 + lane;
  if (lane < kRowsPerSimd && r < p.hidden)
    y[ulong(i) * p.hidden + r] = weights[i] * add_bias(p, rec, p.down_bias, r, res[lane]);
}

#define STRATA_DOWN(fmt_name, ...) STRATA_KERNEL("down_" fmt_name, down, __VA_ARGS__)
STRATA_FOR_EACH_FORMAT(STRATA_DOWN)
