// Popularity: the distinct experts of a routing table, most chosen first. The order every list
// the Window hands the stream is in: the urgent experts (the waves take the most used first,
// ties to the lower id) and the predictions (the budget keeps the likeliest: ties in the order
// given, a router's top-k best first, so a per-layer cap reads the likelier ones).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace strata {

class Popularity {
 public:
  enum class Ties { LowerId, Given };

  explicit Popularity(std::uint32_t n_experts) : votes_(n_experts, 0) {}

  // The distinct ids of ids[0, n) into `out` (cleared first), most chosen first, ties per
  // `ties` (Given: in the order of their first appearance). Ids are in [0, n_experts) (the
  // caller checked them).
  void rank(const std::int32_t* ids, std::uint32_t n, std::vector<std::int32_t>& out,
            Ties ties = Ties::LowerId) {
    out.clear();
    for (std::uint32_t i = 0; i < n; ++i)
      if (votes_[std::uint32_t(ids[i])]++ == 0) out.push_back(ids[i]);
    if (ties == Ties::Given)
      std::stable_sort(out.begin(), out.end(), [&](std::int32_t a, std::int32_t b) {
        return votes_[std::uint32_t(a)] > votes_[std::uint32_t(b)];
      });
    else
      std::sort(out.begin(), out.end(), [&](std::int32_t a, std::int32_t b) {
        const std::uint32_t va = votes_[std::uint32_t(a)], vb = votes_[std::uint32_t(b)];
        return va > vb || (va == vb && a < b);
      });
    for (std::int32_t e : out) votes_[std::uint32_t(e)] = 0;
  }

 private:
  std::vector<std::uint32_t> votes_;  // [n_experts] counts, all zero between calls
};

}  // namespace strata
