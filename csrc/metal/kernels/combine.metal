// combine: out[t] = y[t, 0] + y[t, 1] + ... in j order (the weights were applied by down), so
// the sum has one order whatever passes or waves produced the y rows. Grid
// (ceil(hidden / 64), rows), threadgroup 64.
#include "common.h"

enum : uint { kCombineThreads = 64 };

template <class Unused>
[[kernel]] void combine_rows(STRATA_KERNEL_PARAMS) {
  if (aborted(status)) return;
  const uint c = tg.x * kCombineThreads + tpos.x, t = tg.y;
  if (c >= p.hidden || t >= p.rows) return;
  device const float* yt = y + ulong(t) * p.top_k * p.hidden;
  float acc = yt[c];
  for (uint j = 1; j < p.top_k; ++j) acc += yt[ulong(j) * p.hidden + c];
  out[ulong(t) * p.hidden + c] = acc;
}

STRATA_KERNEL("combine", combine_rows, void)
