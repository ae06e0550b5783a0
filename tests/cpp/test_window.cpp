// The Window over the CPU backend: a multi-turn workload (prompt chunks, waves, decode) with
// prediction on, split on and off, must give bitwise the all-resident output. Under TSan in CI
// this is where host, device, worker and IO threads all meet.
#include <catch2/catch.hpp>

#include <cstdio>
#include <random>

#include "stream_test_util.h"
#include "residency/stream_testing.h"
#include "common/errors.h"
#include "exec/window.h"

using namespace strata;
using namespace strata::test;

namespace {

std::vector<std::vector<float>> run_turns(const std::string& path, const PackLayout& L,
                                          std::uint32_t slots, bool split, bool lookahead,
                                          std::uint32_t max_rows,
                                          const std::vector<std::uint32_t>& sizes) {
  StreamOptions so = small_options(slots, L, 3);
  ExpertStream stream(path, so);
  WindowOptions wo;
  wo.split_turn = split;
  wo.lookahead = lookahead;
  wo.max_rows = max_rows;
  wo.two_layer_prompt = lookahead;  // two-layer prediction too, wherever prediction is on
  wo.two_layer_decode = lookahead;
  wo.two_layer_max = 2;
  Window w(stream, make_cpu_backend(2), wo);
  std::mt19937 rng(99);
  std::normal_distribution<float> nd;
  std::vector<std::vector<float>> outs;
  for (std::uint32_t T : sizes) {
    w.begin_turn();
    for (std::uint32_t l = 0; l < L.n_layers; ++l) {
      std::vector<float> x(std::size_t(T) * L.hidden), out(x.size());
      for (auto& v : x) v = nd(rng);
      w.moe(l, x.data(), T, out.data());
      outs.push_back(out);
      REQUIRE(StreamTesting::check_invariants(stream).empty());
    }
    w.end_turn();
  }
  return outs;
}

}  // namespace

TEST_CASE("window: streamed output is bitwise the all-resident output, split on and off") {
  TestGeometry g;
  g.n_layers = 4;
  g.n_experts = 12;
  g.top_k = 3;
  g.hidden = 64;
  g.moe_intermediate = 48;
  auto path = build_test_pack(g, "window");
  PackLayout L = read_pack_layout(path);
  const std::vector<std::uint32_t> sizes = {9, 1, 1, 2, 1, 7};
  auto want = run_turns(path, L, L.n_keys(), false, false, 1024, sizes);
  for (bool split : {false, true})
    for (std::uint32_t slots : {6u, 9u}) {
      auto got = run_turns(path, L, slots, split, true, 4, sizes);
      REQUIRE(got.size() == want.size());
      for (std::size_t i = 0; i < got.size(); ++i) REQUIRE(got[i] == want[i]);
    }
  std::remove(path.c_str());
}

TEST_CASE("window: out-of-order layers are refused") {
  TestGeometry g;
  auto path = build_test_pack(g, "order");
  PackLayout L = read_pack_layout(path);
  ExpertStream stream(path, small_options(8, L, 1));
  Window w(stream, make_cpu_backend(1), WindowOptions{});
  std::vector<float> x(L.hidden, 0.5f), out(L.hidden);
  w.begin_turn();
  CHECK_THROWS_AS(w.moe(1, x.data(), 1, out.data()), EngineError);
  w.moe(0, x.data(), 1, out.data());
  w.end_turn();
  std::remove(path.c_str());
}
