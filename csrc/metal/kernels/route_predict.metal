// route_predict: the expert ids router[l + distance] would pick on layer l's input, for
// prefetch. The host runs route_logits with layer = l + distance first; this kernel keeps only
// the top-k (no weights) in pred_ids[distance - 1]. Grid ceil(rows / 32), threadgroup 32.
#include "topk.h"

template <class Unused>
[[kernel]] void route_predict(STRATA_KERNEL_PARAMS) {
  if (aborted(status)) return;
  const uint t = tg.x * kTokensPerGroup + tpos.x;
  if (t >= p.rows) return;
  const uint k = p.top_k;
  uint chosen[STRATA_MAX_TOP_K];
  select_topk(logits + ulong(t) * p.n_experts, p.n_experts, k, chosen);
  device int* pred = p.distance == 1u ? pred1 : pred2;
  for (uint j = 0; j < k; ++j) pred[t * k + j] = int(chosen[j]);
}

STRATA_KERNEL("route_predict", route_predict, void)
