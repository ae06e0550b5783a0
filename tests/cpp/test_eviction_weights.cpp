// DecayedLfu's victim order weighs a key's heat by what a miss of its layer costs: a layer whose
// misses all stall (never predicted: the first MoE layer) against one whose misses lookahead
// always read ahead (covered). Without any miss counted, the order is plain decayed LFU.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>

#include "residency/eviction_policy.h"

using strata::KeyHeat;

namespace {
constexpr std::uint32_t kExperts = 4;  // keys 0-3: layer 0, keys 4-7: layer 1
}

TEST_CASE("eviction weights: equal until misses are counted, then by P(stall) + io share") {
  KeyHeat h(2 * kExperts, kExperts, 16.0, 0);
  for (std::uint32_t k = 0; k < 2 * kExperts; ++k) h.on_use(k);
  // No misses yet: each layer's weight is the prior's, the same for both.
  REQUIRE(h.stall_weight(0) == Approx(h.stall_weight(1)));
  REQUIRE(h.ranked_heat(1) - h.heat(1) == Approx(h.ranked_heat(5) - h.heat(5)));

  for (int i = 0; i < 200; ++i) {
    h.on_stalled_miss(0 * kExperts + std::uint32_t(i) % kExperts);  // layer 0: nobody predicted it
    h.on_covered_miss(1 * kExperts + std::uint32_t(i) % kExperts);  // layer 1: read ahead
  }
  // P(stall) with the (1, 2) prior: 201/202 and 1/202; plus the IO share of a covered read.
  REQUIRE(h.stall_weight(0) == Approx(201.0 / 202 + KeyHeat::kIoShare));
  REQUIRE(h.stall_weight(1) == Approx(1.0 / 202 + KeyHeat::kIoShare));

  // Key 4 (layer 1) was used after key 0 (layer 0), so it is hotter by plain heat, yet ranks
  // colder: losing it costs a read ahead, losing key 0 a stall.
  REQUIRE(h.heat(4) > h.heat(0));
  REQUIRE(h.ranked_heat(4) < h.ranked_heat(0));
  // Heat still rules beyond the weights' ratio (about 3): a key used many times more stays.
  for (int i = 0; i < 8; ++i) h.on_use(5);
  REQUIRE(h.ranked_heat(5) > h.ranked_heat(0));
}

TEST_CASE("eviction weights: counts decay, so a layer that starts being predicted gets cheaper") {
  KeyHeat h(2 * kExperts, kExperts, 16.0, 0);
  for (int i = 0; i < 5000; ++i) h.on_stalled_miss(4);
  const double before = h.stall_weight(1);
  for (int i = 0; i < 5000; ++i) h.on_covered_miss(4);
  REQUIRE(before > 1.4);
  // Halving at 4096 misses keeps the old stalls at a fraction of the new covered reads.
  REQUIRE(h.stall_weight(1) < 0.5 + 0.35);
  REQUIRE(h.stall_weight(0) == Approx(1.0));  // layer 0 saw nothing: still the prior
}
