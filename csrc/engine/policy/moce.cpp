#include "policy/moce.h"

#include <algorithm>

namespace strata {

MoceDelta moce_select(const MoceParams& p, const std::uint32_t* rank, const float* prob,
                      const std::uint32_t* resident, std::uint32_t n_experts, std::uint32_t k,
                      std::uint32_t* selected, std::uint32_t* scratch) {
  const std::uint32_t E = n_experts, J = std::min(p.keep_top, k);
  // position[e]: e's place in the true ranking. It orders the final selection and breaks ties
  // between equal scaled scores, so a strength of 1 reproduces the true top-k exactly.
  std::uint32_t* position = scratch;
  for (std::uint32_t r = 0; r < E; ++r) position[rank[r]] = r;
  std::copy(rank, rank + k, selected);
  if (p.mode == MoceMode::Scale && J < k) {
    // The true top-J stay; the other k - J places go to the best scaled scores of the rest.
    std::uint32_t* rest = scratch + E;
    std::copy(rank + J, rank + E, rest);
    auto score = [&](std::uint32_t e) { return resident[e] ? prob[e] * p.strength : prob[e]; };
    std::partial_sort(rest, rest + (k - J), rest + (E - J), [&](std::uint32_t a, std::uint32_t b) {
      const float sa = score(a), sb = score(b);
      return sa > sb || (sa == sb && position[a] < position[b]);
    });
    std::copy(rest, rest + (k - J), selected + J);
  } else if (p.mode == MoceMode::Prune) {
    // Residents outside the true top-k, best first, replace cold low-probability picks, the
    // weakest first: when residents run out, the picks left cold are the likelier ones, so the
    // least probability mass moves.
    std::uint32_t next = k;
    for (std::uint32_t j = k; j-- > J;) {
      const std::uint32_t e = selected[j];
      if (resident[e] || !(prob[e] < p.strength)) continue;
      while (next < E && !resident[rank[next]]) ++next;
      if (next == E) break;  // no resident left to move to
      selected[j] = rank[next++];
    }
  }
  std::sort(selected, selected + k,
            [&](std::uint32_t a, std::uint32_t b) { return position[a] < position[b]; });
  // Dropped = true top-k experts no longer selected; summed in true-rank order.
  MoceDelta d;
  for (std::uint32_t r = 0; r < k; ++r)
    if (std::find(selected, selected + k, rank[r]) == selected + k) {
      d.moved += prob[rank[r]];
      ++d.changed;
    }
  return d;
}

const char* to_string(MoceMode m) {
  switch (m) {
    case MoceMode::Off: return "off";
    case MoceMode::Scale: return "scale";
    case MoceMode::Prune: return "prune";
  }
  return "?";
}

}  // namespace strata
