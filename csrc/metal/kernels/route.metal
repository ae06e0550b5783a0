// route: ids and mixture weights of `rows` tokens from router[layer]. Two kernels, in order:
//  route_logits: logits[t][e] = router[layer][e] . x_t, the decode mat-vec over the f32 router
//    (grid (ceil(E / 8), rows), threadgroup (32, 2));
//  route_select: per token the top-k and the model's weighting rule (grid ceil(rows / 32),
//    threadgroup 32), written step for step as the CPU backend writes it.
// Cache-aware routing (moce) is not implemented here; the host refuses it by name.
#include "matvec.h"
#include "topk.h"

template <class Fmt>
[[kernel]] void route_logits(STRATA_KERNEL_PARAMS) {
  if (aborted(status)) return;
  const uint t = tg.y;
  if (t >= p.rows) return;
  const ulong router_bytes = ulong(p.n_experts) * p.hidden * 4;
  const MatrixRef m[1] = {
      MatrixRef{(device const uchar*)routers + ulong(p.layer) * router_bytes, nullptr, nullptr,
                p.hidden}};
  const uint row0 = tg.x * kRowsPerGroup + sg * kRowsPerSimd;
  float res[kRowsPerSimd];
  dot_rows<Fmt, 1>(m, row0, p.n_experts, x + ulong(t) * p.hidden, p.hidden, lane, res);
  if (lane < kRowsPerSimd && row0 + lane < p.n_experts)
    logits[ulong(t) * p.n_experts + row0 + lane] = res[lane];
}

template <class Unused>
[[kernel]] void route_select(STRATA_KERNEL_PARAMS) {
  if (aborted(status)) return;
  const uint t = tg.x * kTokensPerGroup + tpos.x;
  if (t >= p.rows) return;
  const uint E = p.n_experts, k = p.top_k;
  device const float* logit = logits + ulong(t) * E;
  uint chosen[STRATA_MAX_TOP_K];
  select_topk(logit, E, k, chosen);
  for (uint j = 0; j < k; ++j) ids[t * k + j] = int(chosen[j]);
  device float* w = weights + ulong(t) * k;
  if (p.routing == 0u) {
    // Softmax over every expert, shifted by the largest logit; the chosen probabilities,
    // renormalised to sum 1 when the model asks.
    const float top = logit[chosen[0]];
    float total = 0.0f;
    for (uint e = 0; e < E; ++e) total += exp(logit[e] - top);
    float sum = 0.0f;
    for (uint j = 0; j < k; ++j) {
      w[j] = exp(logit[chosen[j]] - top) / total;
      sum += w[j];
    }
    if (p.norm_topk_prob != 0u)
      for (uint j = 0; j < k; ++j) w[j] = w[j] / sum;
  } else {
    // Mixtral: softmax over the k chosen logits only.
    const float top = logit[chosen[0]];
    float total = 0.0f;
    for (uint j = 0; j < k; ++j) total += exp(logit[chosen[j]] - top);
    for (uint j = 0; j < k; ++j) w[j] = exp(logit[chosen[j]] - top) / total;
  }
}

STRATA_KERNEL("route_logits", route_logits, FloatFormat<LoadF32>)
STRATA_KERNEL("route_select", route_select, void)
