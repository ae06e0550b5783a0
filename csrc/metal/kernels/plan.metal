// plan: plan[i] = smap[layer][ids[i]] for every routed entry, the snapshot the resident pass
// runs from (ABSENT = the expert goes to the missing pass). Grid ceil(rows * top_k / 64),
// threadgroup 64.
#include "common.h"

enum : uint { kPlanThreads = 64 };

template <class Unused>
[[kernel]] void plan_entries(STRATA_KERNEL_PARAMS) {
  if (aborted(status)) return;
  const uint i = tg.x * kPlanThreads + tpos.x;
  if (i >= p.rows * p.top_k) return;
  plan[i] = smap[p.layer * p.n_experts + uint(ids[i])];
}

STRATA_KERNEL("plan", plan_entries, void)
