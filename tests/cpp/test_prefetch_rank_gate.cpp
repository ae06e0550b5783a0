// The prefetch governor's per-rank gate (prefetch_governor.h, 4.): the rule on synthetic
// observations, then through a Window whose predictions are right at some ranks and wrong at
// others, where it must stop reading the wrong ranks alone and leave every output bit as it is.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "common/errors.h"
#include "exec/window.h"
#include "policy/prefetch_governor.h"
#include "residency/stream_testing.h"
#include "stream_test_util.h"

using namespace strata;
using namespace strata::test;

namespace {

GovernorOptions rank_only(double rank_precision) {
  GovernorOptions o;
  o.epoch = 4;
  o.min_issued = 1u << 30;  // the global rule never judges
  o.trial_every = 0;        // no timing
  o.layer_precision = 0;    // no per-layer gate: the rank gate alone
  o.rank_precision = rank_precision;
  return o;
}

}  // namespace

TEST_CASE("rank gate: a rank that predicts badly is held back, the ranks above it are not",
          "[governor][rank]") {
  PrefetchGovernor g(rank_only(0.5));
  const std::uint32_t min = g.options().rank_min_trials;
  for (std::uint32_t i = 0; i < min - 1; ++i) {
    g.observe_rank(3, 0, true);          // rank 0: always chosen
    g.observe_rank(3, 1, i % 4 != 0);    // rank 1: three in four
    g.observe_rank(3, 2, i % 4 == 0);    // rank 2: one in four
  }
  // Too little evidence yet: nothing is held back on it.
  CHECK_FALSE(g.rank_gated(3, 2));
  g.observe_rank(3, 0, true);
  g.observe_rank(3, 1, true);
  g.observe_rank(3, 2, false);
  CHECK_FALSE(g.rank_gated(3, 0));
  CHECK_FALSE(g.rank_gated(3, 1));
  CHECK(g.rank_gated(3, 2));
  CHECK(g.rank_precision(3, 0) == Approx(1.0));
  CHECK(g.rank_precision(3, 2) < 0.5);
  // Other layers and ranks never observed are read.
  CHECK_FALSE(g.rank_gated(2, 2));
  CHECK_FALSE(g.rank_gated(3, 7));
  CHECK(g.rank_precision(3, 7) == -1);
}

TEST_CASE("rank gate: a held-back rank whose predictions turn right is read again",
          "[governor][rank]") {
  PrefetchGovernor g(rank_only(0.5));
  for (int i = 0; i < 40; ++i) g.observe_rank(1, 5, false);
  REQUIRE(g.rank_gated(1, 5));
  // Evidence keeps coming while it is held back (it is measured whether or not it was read),
  // and the decay lets the recent observations outweigh the old ones.
  int reopened_after = -1;
  for (int i = 0; i < 200 && reopened_after < 0; ++i) {
    g.observe_rank(1, 5, true);
    if (!g.rank_gated(1, 5)) reopened_after = i + 1;
  }
  CHECK(reopened_after > 0);
  CHECK(reopened_after < 40);  // sooner than the bad stretch lasted
}

TEST_CASE("rank gate: off at rank_precision 0; its options are checked", "[governor][rank]") {
  PrefetchGovernor g(rank_only(0));
  for (int i = 0; i < 100; ++i) g.observe_rank(0, 0, false);
  CHECK_FALSE(g.rank_gated(0, 0));
  GovernorOptions bad = rank_only(1.5);
  CHECK_THROWS_AS(PrefetchGovernor(bad), EngineError);
  bad = rank_only(0.5);
  bad.rank_decay = 0;
  CHECK_THROWS_AS(PrefetchGovernor(bad), EngineError);
}

namespace {

struct DecodeRun {
  std::vector<std::vector<float>> outs;
  std::uint64_t issued = 0, used = 0;  // speculative reads over the second half of the tokens
  std::uint64_t misses = 0;            // urgent misses, the same span
};

// Decode `tokens` one-row tokens; the prediction for layer l+1 is right at ranks [0, good)
// (layer l+1's own choices, best first) and wrong at the others (experts it does not choose).
DecodeRun decode(const std::string& path, const PackLayout& L, std::uint32_t slots,
                 double rank_precision, std::uint32_t tokens, std::uint32_t good) {
  ExpertStream stream(path, small_options(slots, L, 2));
  WindowOptions wo;
  wo.start_layers = 0;
  wo.governor = rank_only(rank_precision);
  Window w(stream, make_cpu_backend(2), wo);
  std::mt19937 rng(11);
  std::normal_distribution<float> nd;
  DecodeRun run;
  const StreamStats& s = stream.stats();
  std::uint64_t issued0 = 0, used0 = 0, misses0 = 0;
  for (std::uint32_t t = 0; t < tokens; ++t) {
    if (t == tokens / 2) {
      issued0 = s.spec_requests.load();
      used0 = s.spec_hits.load();
      misses0 = s.misses.load();
    }
    std::vector<std::vector<std::int32_t>> ids(L.n_layers);
    for (auto& row : ids) {
      std::vector<std::int32_t> perm(L.n_experts);
      for (std::uint32_t e = 0; e < L.n_experts; ++e) perm[e] = std::int32_t(e);
      std::shuffle(perm.begin(), perm.end(), rng);
      row.assign(perm.begin(), perm.begin() + 2 * L.top_k);  // top_k chosen, then top_k not
    }
    w.begin_turn();
    for (std::uint32_t l = 0; l < L.n_layers; ++l) {
      std::vector<float> x(L.hidden), wts(L.top_k), out(L.hidden);
      for (auto& v : x) v = nd(rng);
      for (std::uint32_t j = 0; j < L.top_k; ++j) wts[j] = 1.0f / float(j + 1);
      std::vector<std::int32_t> pred;
      if (l + 1 < L.n_layers) {
        const auto& next = ids[l + 1];
        pred.assign(next.begin(), next.begin() + good);
        pred.insert(pred.end(), next.begin() + L.top_k, next.begin() + L.top_k + (L.top_k - good));
      }
      Window::Routed r;
      r.ids = ids[l].data();
      r.weights = wts.data();
      if (!pred.empty()) r.pred1 = pred.data();
      w.moe_routed(l, x.data(), Window::XType::F32, 1, r, out.data());
      run.outs.push_back(std::move(out));
    }
    w.end_turn();
    REQUIRE(StreamTesting::check_invariants(stream).empty());
  }
  run.issued = s.spec_requests.load() - issued0;
  run.used = s.spec_hits.load() - used0;
  run.misses = s.misses.load() - misses0;
  return run;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

}  // namespace

TEST_CASE("rank gate: a Window stops reading the wrong ranks, keeps the right ones, same bits",
          "[governor][rank][window]") {
  TestGeometry g;
  g.n_layers = 4;
  g.n_experts = 16;
  g.top_k = 4;
  auto path = build_test_pack(g, "rank_gate");
  PackLayout L = read_pack_layout(path);
  const std::uint32_t slots = 3 * g.top_k + 4, tokens = 120, good = 2;
  const DecodeRun off = decode(path, L, slots, 0, tokens, good);
  const DecodeRun on = decode(path, L, slots, 0.5, tokens, good);
  // Without the gate half the absent predictions are wrong; with it, once each rank has its
  // evidence, the wrong ranks are no longer read.
  REQUIRE(off.issued > 0);
  const double unused_off = 1.0 - double(off.used) / double(off.issued);
  const double unused_on = 1.0 - double(on.used) / double(std::max<std::uint64_t>(on.issued, 1));
  CHECK(unused_off > 0.3);
  CHECK(unused_on < 0.1);
  // The right ranks are still read: every urgent request they cover is covered with the gate
  // too, so it misses no more than without (the wrong reads' evictions are gone as well).
  CHECK(on.used > 0);
  CHECK(on.misses <= off.misses);
  // Prediction only steers reads: every output bit is the same.
  REQUIRE(on.outs.size() == off.outs.size());
  for (std::size_t i = 0; i < on.outs.size(); ++i) REQUIRE(same_bits(on.outs[i], off.outs[i]));
  std::remove(path.c_str());
}
