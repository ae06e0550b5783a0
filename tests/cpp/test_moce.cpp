// moce_select on hand-worked tokens, and ExpertStream::settle (the deterministic moce path).
#include <catch2/catch.hpp>

#include <cstdio>
#include <vector>

#include "policy/moce.h"
#include "stream_test_util.h"
#include "residency/stream_testing.h"

using namespace strata;
using namespace strata::test;

namespace {

// Six experts already in true order: expert e has rank e.
struct Token {
  std::vector<std::uint32_t> rank = {0, 1, 2, 3, 4, 5};
  std::vector<float> prob = {0.40f, 0.20f, 0.15f, 0.12f, 0.08f, 0.05f};
  std::vector<std::uint32_t> resident = {0, 0, 0, 1, 0, 1};  // experts 3 and 5

  std::vector<std::uint32_t> select(MoceMode mode, float strength, std::uint32_t keep,
                                    MoceDelta* d) {
    std::vector<std::uint32_t> out(3), scratch(12);
    *d = moce_select(MoceParams{mode, strength, keep}, rank.data(), prob.data(),
                     resident.data(), 6, 3, out.data(), scratch.data());
    return out;
  }
};

}  // namespace

TEST_CASE("moce scale: resident probabilities times strength compete for the places after top-J") {
  Token t;
  MoceDelta d;
  // Scores after expert 0: 1 -> .20, 2 -> .15, 3 -> .24, 4 -> .08, 5 -> .10.
  CHECK(t.select(MoceMode::Scale, 2.0f, 1, &d) == std::vector<std::uint32_t>{0, 1, 3});
  CHECK(d.changed == 1);
  CHECK(d.moved == Approx(0.15f));
  // Strength 1 is exact routing; keeping the whole top-k leaves nothing to change.
  CHECK(t.select(MoceMode::Scale, 1.0f, 1, &d) == std::vector<std::uint32_t>{0, 1, 2});
  CHECK(d.changed == 0);
  CHECK(t.select(MoceMode::Scale, 100.0f, 3, &d) == std::vector<std::uint32_t>{0, 1, 2});
  CHECK(d.changed == 0);
  // Keep only the top-1 and boost hard: both residents come in, reported in true-rank order.
  CHECK(t.select(MoceMode::Scale, 100.0f, 1, &d) == std::vector<std::uint32_t>{0, 3, 5});
  CHECK(d.changed == 2);
  CHECK(d.moved == Approx(0.35f));
}

TEST_CASE("moce prune: cold picks below the threshold give way to the best residents") {
  Token t;
  MoceDelta d;
  CHECK(t.select(MoceMode::Prune, 0.13f, 1, &d) == std::vector<std::uint32_t>{0, 1, 2});
  CHECK(d.changed == 0);
  CHECK(t.select(MoceMode::Prune, 0.16f, 1, &d) == std::vector<std::uint32_t>{0, 1, 3});
  CHECK(d.changed == 1);
  CHECK(d.moved == Approx(0.15f));
  CHECK(t.select(MoceMode::Prune, 0.5f, 1, &d) == std::vector<std::uint32_t>{0, 3, 5});
  CHECK(d.moved == Approx(0.35f));
  // The top-J stay even when cold and below the threshold.
  CHECK(t.select(MoceMode::Prune, 0.5f, 2, &d) == std::vector<std::uint32_t>{0, 1, 3});
  // No resident left: a cold pick stays.
  t.resident = {0, 0, 0, 0, 0, 1};
  CHECK(t.select(MoceMode::Prune, 0.5f, 1, &d) == std::vector<std::uint32_t>{0, 1, 5});
  CHECK(d.changed == 1);
  // A resident pick in the true top-k is never pruned.
  t.resident = {0, 0, 1, 0, 0, 0};
  CHECK(t.select(MoceMode::Prune, 0.5f, 1, &d) == std::vector<std::uint32_t>{0, 1, 2});
  CHECK(d.changed == 0);
}

TEST_CASE("settle returns only when no read is queued or in flight") {
  TestGeometry g;
  auto path = build_test_pack(g, "settle");
  PackLayout L = read_pack_layout(path);
  for (std::uint32_t threads : {0u, 2u}) {
    ExpertStream s(path, small_options(8, L, threads));
    std::int32_t ex[] = {1, 2, 3};
    s.enter_layer(0);
    s.request(1, ex, 3, ReadClass::Pred1);
    s.request(2, ex, 2, ReadClass::Pred2);
    s.settle();
    CHECK(StreamTesting::pending_jobs(s).empty());
    for (const SlotInfo& si : s.slots()) {
      CHECK(si.parts_started == si.parts_done);
      CHECK(si.state != SlotState::Queued);
      CHECK(si.state != SlotState::Reading);
    }
    CHECK(s.smap_at(1 * g.n_experts + 1) == kAbsent);  // settled, still unpublished (I2)
    CHECK(StreamTesting::check_invariants(s).empty());
  }
  std::remove(path.c_str());
}
