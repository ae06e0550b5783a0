// A backend whose set-up fails when the Window hands it bigger buffers (the CUDA backend's bind
// allocates device scratch and registers host memory: either can fail). The call is a Device
// error naming the backend, the stream and the Window stay usable, and the next call binds
// again: before, the Window had already replaced its scratch, kept believing the backend held
// it, and the next call ran the backend on the freed buffers (a use-after-free that ASan
// reports, and wrong output without it).
#include <catch2/catch.hpp>

#include <stdexcept>

#include "common/errors.h"
#include "exec/window.h"
#include "residency/stream_testing.h"
#include "delegating_backend.h"
#include "stream_test_util.h"

using namespace strata;
using namespace strata::test;

namespace {

class FailingBindBackend final : public DelegatingBackend {
 public:
  // Binds number `fail_at` (1 = the constructor's) throws, as a device allocation would.
  FailingBindBackend(unsigned fail_at, unsigned* submits_unbound)
      : fail_at_(fail_at), submits_unbound_(submits_unbound) {}
  std::string name() const override { return "failing-bind"; }
  void bind(const DeviceBuffers& b) override {
    bound_ = false;
    if (++binds_ == fail_at_)
      throw std::runtime_error("cudaMalloc (device scratch): out of memory");
    inner().bind(b);
    bound_ = true;
  }
  void submit(const std::vector<Command>& cs) override {
    if (!bound_) ++*submits_unbound_;  // the inner backend would run on buffers it no longer has
    inner().submit(cs);
  }

 private:
  unsigned binds_ = 0;
  const unsigned fail_at_;
  unsigned* submits_unbound_;
  bool bound_ = false;
};

}  // namespace

TEST_CASE("window: a backend whose bind fails is a Device error, and the next call binds again") {
  TestGeometry g;
  g.n_layers = 2;
  g.n_experts = 10;
  g.top_k = 2;
  auto path = build_test_pack(g, "bind_failure");
  PackLayout L = read_pack_layout(path);
  ExpertStream stream(path, small_options(L.n_keys(), L, 2));
  WindowOptions wo;
  wo.max_rows = 16;
  unsigned submits_unbound = 0;
  Window host(stream, make_cpu_backend(1), wo);
  Window w(stream, std::make_unique<FailingBindBackend>(2, &submits_unbound), wo);
  auto call = [&](Window& win, std::uint32_t layer, const CallRows& r, std::uint32_t T) {
    const Window::Routed routed = r.routed();
    std::vector<float> out(r.x.size(), -1.0f);
    win.moe_routed(layer, r.x.data(), Window::XType::F32, T, routed, out.data());
    return out;
  };
  const CallRows one = make_rows(L, 1, 3), nine = make_rows(L, 9, 4);
  // The CPU backend's outputs: a turn of one row a layer, then one of nine.
  std::vector<std::vector<float>> want_one, want_nine;
  for (std::uint32_t l = 0; l < L.n_layers; ++l) want_one.push_back(call(host, l, one, 1));
  for (std::uint32_t l = 0; l < L.n_layers; ++l) want_nine.push_back(call(host, l, nine, 9));
  CHECK(call(w, 0, one, 1) == want_one[0]);  // one row: the constructor's buffers
  // Nine rows at layer 1 grow the scratch; the backend's second bind throws.
  try {
    call(w, 1, nine, 9);
    FAIL("the failed bind was not raised");
  } catch (const EngineError& e) {
    CHECK(e.kind() == ErrorKind::Device);
    const std::string what = e.what();
    CHECK(what.find("failing-bind backend could not take its buffers for 9 rows") !=
          std::string::npos);
    CHECK(what.find("out of memory") != std::string::npos);
  }
  CHECK_FALSE(w.in_turn());  // the call was abandoned, its turn ended
  // The next turn binds again (the third bind succeeds) and computes what the CPU backend does.
  for (std::uint32_t l = 0; l < L.n_layers; ++l)
    CHECK(call(w, l, nine, 9) == want_nine[l]);
  CHECK(submits_unbound == 0);
  CHECK(StreamTesting::check_invariants(stream).empty());
}
