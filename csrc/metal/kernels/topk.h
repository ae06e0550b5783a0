// Top-k of one token's router logits, as the CPU backend ranks them: by logit (softmax is
// monotonic), ties to the lower expert index. One thread per token: k * E comparisons is
// nothing next to the logits' mat-vec, and a single thread's order is trivially deterministic.
#pragma once

#include "common.h"

enum : uint { kTokensPerGroup = 32 };

inline void select_topk(device const float* logit, uint n_experts, uint k, thread uint* chosen) {
  for (uint j = 0; j < k; ++j) {
    uint best = STRATA_ABSENT;
    float best_logit = 0.0f;
    for (uint e = 0; e < n_experts; ++e) {
      bool taken = false;
      for (uint q = 0; q < j; ++q) taken = taken || chosen[q] == e;
      if (taken) continue;
      if (best == STRATA_ABSENT || logit[e] > best_logit) {
        best = e;
        best_logit = logit[e];
      }
    }
    chosen[j] = best;
  }
}
