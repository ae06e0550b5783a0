// Externally routed calls: the model's ids and weights through the same handshake. The backend
// path must be bitwise identical across arena sizes and split modes (I11); the host path must
// offer every entry exactly once, in a slot that holds its expert's record while compute runs.
// Under TSan this is where the host callback meets the IO threads.
#include <catch2/catch.hpp>

#include <random>

#include <cstring>

#include "common/errors.h"
#include "cpu/mlx_arithmetic.h"
#include "exec/window.h"
#include "delegating_backend.h"
#include "stream_test_util.h"
#include "residency/stream_testing.h"

using namespace strata;
using namespace strata::test;

namespace {

struct Call {
  std::vector<float> x, w;
  std::vector<std::int32_t> ids;
};

std::vector<std::vector<Call>> make_turns(const PackLayout& L, const std::vector<std::uint32_t>& sizes) {
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  std::vector<std::vector<Call>> turns;
  for (std::uint32_t T : sizes) {
    std::vector<Call> calls;
    for (std::uint32_t l = 0; l < L.n_layers; ++l) {
      Call c;
      c.x.resize(std::size_t(T) * L.hidden);
      for (auto& v : c.x) v = nd(rng);
      for (std::uint32_t t = 0; t < T; ++t) {
        std::vector<std::int32_t> perm(L.n_experts);
        for (std::uint32_t e = 0; e < L.n_experts; ++e) perm[e] = std::int32_t(e);
        std::shuffle(perm.begin(), perm.end(), rng);
        for (std::uint32_t j = 0; j < L.top_k; ++j) {
          c.ids.push_back(perm[j]);
          c.w.push_back(1.0f / float(j + 1));
        }
      }
      calls.push_back(std::move(c));
    }
    turns.push_back(std::move(calls));
  }
  return turns;
}

std::vector<std::vector<float>> run_routed(const std::string& path, const PackLayout& L,
                                           std::uint32_t slots, bool split,
                                           const std::vector<std::vector<Call>>& turns,
                                           Rounding rounding = {}) {
  ExpertStream stream(path, small_options(slots, L, 3));
  WindowOptions wo;
  wo.split_turn = split;
  wo.max_rows = 6;
  Window w(stream, make_cpu_backend(2), wo);
  std::vector<std::vector<float>> outs;
  for (const auto& calls : turns) {
    w.begin_turn();
    for (std::uint32_t l = 0; l < L.n_layers; ++l) {
      const Call& c = calls[l];
      const std::uint32_t T = std::uint32_t(c.x.size() / L.hidden);
      Window::Routed r;
      r.ids = c.ids.data();
      r.weights = c.w.data();
      r.rounding = rounding;
      if (l + 1 < L.n_layers) r.pred1 = calls[l + 1].ids.data();  // a perfect prediction
      std::vector<float> out(c.x.size());
      w.moe_routed(l, c.x.data(), Window::XType::F32, T, r, out.data());
      outs.push_back(out);
      REQUIRE(StreamTesting::check_invariants(stream).empty());
    }
    w.end_turn();
  }
  return outs;
}

}  // namespace

TEST_CASE("window: routed calls are bitwise identical across arena sizes and split modes") {
  TestGeometry g;
  g.n_layers = 3;
  g.n_experts = 10;
  g.top_k = 2;
  auto path = build_test_pack(g, "routed");
  PackLayout L = read_pack_layout(path);
  auto turns = make_turns(L, {8, 1, 1, 3});
  auto want = run_routed(path, L, L.n_keys(), false, turns);
  for (std::uint32_t slots : {2 * g.top_k, 2 * g.top_k + 3})
    for (bool split : {false, true}) {
      auto got = run_routed(path, L, slots, split, turns);
      REQUIRE(got.size() == want.size());
      for (std::size_t i = 0; i < got.size(); ++i) REQUIRE(got[i] == want[i]);
    }
  std::remove(path.c_str());
}

// Bits, not values: NaN must compare equal to the same NaN.
bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

TEST_CASE("window: routed calls in MLX's arithmetic are bitwise identical across arena sizes") {
  // A q4 pack with bfloat16 scales (group 32): the Mlx kernels' tiles, lanes past the last row
  // and both activations' paths run here under the sanitizers too.
  TestGeometry g;
  g.n_layers = 3;
  g.n_experts = 10;
  g.top_k = 2;
  g.hidden = 96;  // with 2 workers, rows go in chunks of 12: a full tile of 8 lanes, then 4
  g.moe_intermediate = 96;
  // And an mxfp4 pack: MLX's other quantized kernel (group sums, then the E8M0 scale).
  const auto format = GENERATE(std::pair<std::uint32_t, std::uint32_t>{3, 2},
                               std::pair<std::uint32_t, std::uint32_t>{5, 3});
  auto path = build_test_pack(g, "routed_mlx", format.first, 32, format.second);
  PackLayout L = read_pack_layout(path);
  auto turns = make_turns(L, {8, 1, 3});
  for (auto& calls : turns)  // bfloat16 activations, as MLX would hand them over
    for (auto& c : calls)
      for (auto& v : c.x) v = cpu::mlx::round_bf16(v);
  for (bool weights_bf16 : {false, true}) {
    Rounding rounding{Arithmetic::MlxBfloat16, weights_bf16};
    auto want = run_routed(path, L, L.n_keys(), false, turns, rounding);
    auto f32 = run_routed(path, L, L.n_keys(), false, turns);
    REQUIRE(!same_bits(want[0], f32[0]));  // the two arithmetics differ on these inputs
    for (std::uint32_t slots : {2 * g.top_k, 2 * g.top_k + 3})
      for (bool split : {false, true}) {
        auto got = run_routed(path, L, slots, split, turns, rounding);
        REQUIRE(got.size() == want.size());
        for (std::size_t i = 0; i < got.size(); ++i) REQUIRE(same_bits(got[i], want[i]));
      }
  }
  std::remove(path.c_str());
}

TEST_CASE("window: an arithmetic the pack cannot have is refused by name, the stream usable") {
  TestGeometry g;
  g.n_layers = 2;
  g.n_experts = 6;
  auto path = build_test_pack(g, "routed_f32_mlx");  // f32 experts: MLX uses another kernel
  PackLayout L = read_pack_layout(path);
  ExpertStream stream(path, small_options(L.n_keys(), L, 2));
  Window w(stream, make_cpu_backend(1), WindowOptions{});
  std::vector<float> x(L.hidden, 0.5f), out(L.hidden), wt = {0.5f, 0.5f};
  std::vector<std::int32_t> ids = {0, 1};
  Window::Routed r;
  r.ids = ids.data();
  r.weights = wt.data();
  r.rounding.arithmetic = Arithmetic::MlxBfloat16;
  try {
    w.moe_routed(0, x.data(), Window::XType::F32, 1, r, out.data());
    FAIL("an f32 pack ran in MLX's bf16 arithmetic");
  } catch (const EngineError& e) {
    REQUIRE(e.kind() == ErrorKind::Config);
    REQUIRE(std::string(e.what()).find("q4/q8") != std::string::npos);
  }
  r.rounding = {};
  w.moe_routed(0, x.data(), Window::XType::F32, 1, r, out.data());
  w.moe_routed(1, x.data(), Window::XType::F32, 1, r, out.data());
  REQUIRE(StreamTesting::check_invariants(stream).empty());
  std::remove(path.c_str());
}

TEST_CASE("window: the host path offers every entry once, in a slot holding its expert") {
  TestGeometry g;
  g.n_layers = 3;
  g.n_experts = 10;
  g.top_k = 2;
  auto path = build_test_pack(g, "routed_host");
  PackLayout L = read_pack_layout(path);
  auto turns = make_turns(L, {9, 1, 2});
  for (std::uint32_t slots : {2 * g.top_k, L.n_keys()}) {
    ExpertStream stream(path, small_options(slots, L, 3));
    Window w(stream, make_cpu_backend(2), WindowOptions{});
    for (const auto& calls : turns) {
      w.begin_turn();
      for (std::uint32_t l = 0; l < L.n_layers; ++l) {
        const Call& c = calls[l];
        const std::uint32_t T = std::uint32_t(c.x.size() / L.hidden);
        std::vector<int> seen(c.ids.size(), 0);
        Window::Routed r;
        r.ids = c.ids.data();
        w.moe_routed_external(l, T, r, [&](std::uint32_t row0, std::uint32_t n, const std::uint32_t* s) {
          for (std::uint32_t i = 0; i < n * L.top_k; ++i) {
            if (s[i] == kAbsent) continue;
            const std::size_t entry = std::size_t(row0) * L.top_k + i;
            ++seen[entry];
            auto rec = expected_record(g, l, std::uint32_t(c.ids[entry]));
            REQUIRE(std::memcmp(stream.arena().slot(s[i]), rec.data(), rec.size()) == 0);
          }
        });
        for (int v : seen) REQUIRE(v == 1);
        REQUIRE(StreamTesting::check_invariants(stream).empty());
      }
      w.end_turn();
    }
  }
  std::remove(path.c_str());
}

TEST_CASE("window: routed calls reject bad ids and keep the stream usable") {
  TestGeometry g;
  g.n_layers = 2;
  g.n_experts = 6;
  auto path = build_test_pack(g, "routed_bad");
  PackLayout L = read_pack_layout(path);
  ExpertStream stream(path, small_options(L.n_keys(), L, 2));
  Window w(stream, make_cpu_backend(1), WindowOptions{});
  std::vector<float> x(L.hidden, 0.5f), out(L.hidden), wt = {0.5f, 0.5f};
  std::vector<std::int32_t> bad = {0, 6}, good = {0, 1};
  Window::Routed r;
  r.ids = bad.data();
  r.weights = wt.data();
  w.begin_turn();
  REQUIRE_THROWS_AS(w.moe_routed(0, x.data(), Window::XType::F32, 1, r, out.data()),
                    std::out_of_range);
  r.ids = good.data();
  r.pred1 = bad.data();
  REQUIRE_THROWS_AS(w.moe_routed(0, x.data(), Window::XType::F32, 1, r, out.data()),
                    std::out_of_range);
  r.pred1 = nullptr;
  w.moe_routed(0, x.data(), Window::XType::F32, 1, r, out.data());
  w.moe_routed(1, x.data(), Window::XType::F32, 1, r, out.data());
  w.end_turn();
  REQUIRE(StreamTesting::check_invariants(stream).empty());
  std::remove(path.c_str());
}

TEST_CASE("pack: version 2's model block is validated") {
  TestGeometry g;
  auto path = build_test_pack(g, "model_block");
  auto patch = [&](std::uint64_t off, std::uint32_t v) {
    poke(path, off, &v, 4);
    std::vector<unsigned char> h(kHeaderBytes);
    FILE* f = std::fopen(path.c_str(), "rb");
    REQUIRE(std::fread(h.data(), 1, h.size(), f) == h.size());
    std::fclose(f);
    std::uint32_t crc = crc32_bytes(h.data(), 4092);
    poke(path, 4092, &crc, 4);
  };
  patch(kModelBlockOffset, 1);  // swiglu_oai without alpha/limit
  REQUIRE_THROWS_WITH(read_pack_layout(path), Catch::Contains("act_alpha/act_limit"));
  float alpha = 1.702f, limit = 7.0f;
  std::uint32_t a, b;
  std::memcpy(&a, &alpha, 4);
  std::memcpy(&b, &limit, 4);
  patch(kModelBlockOffset + 4, a);
  patch(kModelBlockOffset + 8, b);
  PackLayout L = read_pack_layout(path);
  REQUIRE(L.activation == Activation::SwigluOai);
  REQUIRE(L.act_alpha == alpha);
  patch(kModelBlockOffset + 12, 9);
  REQUIRE_THROWS_WITH(read_pack_layout(path), Catch::Contains("bias_format is 9"));
  // Biases claimed, but the tensor table has none: the canonical layout with biases is longer.
  patch(kModelBlockOffset + 12, 1);
  REQUIRE_THROWS_WITH(read_pack_layout(path),
                      Catch::Contains("header field record_bytes is") &&
                          Catch::Contains("but the geometry and format imply"));
  patch(kModelBlockOffset + 12, 0);
  patch(36, 2);  // external routing, but router_bytes is still set
  REQUIRE_THROWS_WITH(read_pack_layout(path), Catch::Contains("router_bytes"));
  std::remove(path.c_str());
}

namespace {

// The CPU backend, counting the submissions it is handed.
class CountingBackend final : public DelegatingBackend {
 public:
  explicit CountingBackend(std::uint32_t* submits) : n_(submits) {}
  void submit(const std::vector<Command>& cs) override {
    ++*n_;
    inner().submit(cs);
  }

 private:
  std::uint32_t* n_;
};

}  // namespace

TEST_CASE("window: the external path never submits to the device; moe_routed once per chunk") {
  TestGeometry g;
  g.n_layers = 3;
  g.n_experts = 10;
  g.top_k = 2;
  auto path = build_test_pack(g, "routed_submits");
  PackLayout L = read_pack_layout(path);
  auto turns = make_turns(L, {9, 1, 2});
  for (bool split : {false, true}) {
    ExpertStream stream(path, small_options(L.n_keys(), L, 2));
    std::uint32_t submits = 0;
    WindowOptions wo;
    wo.split_turn = split;
    Window w(stream, std::make_unique<CountingBackend>(&submits), wo);
    for (const auto& calls : turns) {
      w.begin_turn();
      for (std::uint32_t l = 0; l < L.n_layers; ++l) {
        const Call& c = calls[l];
        const std::uint32_t T = std::uint32_t(c.x.size() / L.hidden);
        Window::Routed r;
        r.ids = c.ids.data();
        std::uint32_t waves = 0;
        w.moe_routed_external(l, T, r, [&](std::uint32_t, std::uint32_t, const std::uint32_t*) {
          ++waves;
        });
        CHECK(waves >= 1);
      }
      w.end_turn();
    }
    CHECK(submits == 0);  // no round trip through the device thread for a host-computed layer
    // The same calls through the backend: one-piece mode submits once per chunk; split mode
    // skips the first submission (routing given) and submits each step.
    std::vector<float> out;
    w.begin_turn();
    for (std::uint32_t l = 0; l < L.n_layers; ++l) {
      const Call& c = turns[1][l];  // one decode row
      Window::Routed r;
      r.ids = c.ids.data();
      r.weights = c.w.data();
      out.resize(c.x.size());
      w.moe_routed(l, c.x.data(), Window::XType::F32, 1, r, out.data());
    }
    w.end_turn();
    CHECK(submits == (split ? 2u : 1u) * L.n_layers);
  }
  std::remove(path.c_str());
}
