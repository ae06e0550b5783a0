// Window::moe_routed_device and the seam it crosses (Capability::io, Backend::set_device_io),
// without a GPU: a backend that takes host memory for "device" memory stands in for the cuda
// one. It copies the caller's x rows into the bound scratch when a chunk's rows are set, and
// the scratch's out into the caller's rows when they are cleared (the Window clears them only
// after the chunk's last Signal), so the output must be moe_routed's, bitwise, and the
// pointers the Window hands over are checked one by one.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstring>
#include <random>

#include "common/errors.h"
#include "exec/window.h"
#include "residency/stream_testing.h"
#include "delegating_backend.h"
#include "stream_test_util.h"

using namespace strata;
using namespace strata::test;

namespace {

class HostAsDeviceBackend final : public DelegatingBackend {
 public:
  struct Seen {
    const float* x;
    float* out;
  };
  explicit HostAsDeviceBackend(std::vector<Seen>* seen, const float* refuse = nullptr)
      : seen_(seen), refuse_(refuse) {}
  std::string name() const override { return "host-as-device"; }
  std::optional<std::string> unsupported(const Capability& c) const override {
    Capability host = c;
    host.io = Io::Host;
    return inner().unsupported(host);
  }
  void bind(const DeviceBuffers& b) override {
    buffers_ = b;
    inner().bind(b);
  }
  void set_device_io(const DeviceIo& io) override {
    if (io.x && io.x == refuse_) throw std::invalid_argument("x is not memory of this device");
    seen_->push_back({io.x, io.out});
    if (!io.x && io_.out) {  // the chunk ended: its out, complete, goes to the caller's rows
      inner().synchronize();
      std::memcpy(io_.out, buffers_.out, rows_ * std::size_t(buffers_.layout->hidden) * 4);
    }
    io_ = io;
    rows_ = 0;
  }
  void submit(const std::vector<Command>& cs) override {
    std::uint32_t rows = 0;
    for (const Command& c : cs) rows = std::max(rows, c.rows);
    if (io_.x && rows > rows_) {  // the first submission of the chunk: its x into the scratch
      inner().synchronize();
      std::memcpy(buffers_.x, io_.x, rows * std::size_t(buffers_.layout->hidden) * 4);
      rows_ = rows;
    }
    inner().submit(cs);
  }

 private:
  std::vector<Seen>* seen_;
  const float* refuse_;
  DeviceBuffers buffers_;
  DeviceIo io_;
  std::uint32_t rows_ = 0;
};

}  // namespace

TEST_CASE("window: moe_routed_device hands each chunk's rows to the backend, output bitwise") {
  TestGeometry g;
  g.n_layers = 2;
  g.n_experts = 10;
  g.top_k = 2;
  auto path = build_test_pack(g, "device_io");
  PackLayout L = read_pack_layout(path);
  const std::uint32_t H = L.hidden;
  for (bool split : {false, true}) {
    for (std::uint32_t T : {1u, 9u}) {
      ExpertStream stream(path, small_options(L.n_keys(), L, 2));
      WindowOptions wo;
      wo.split_turn = split;
      wo.max_rows = 4;  // 9 rows: chunks of 4, 4, 1
      std::vector<HostAsDeviceBackend::Seen> seen;
      Window dev(stream, std::make_unique<HostAsDeviceBackend>(&seen), wo);
      Window host(stream, make_cpu_backend(1), wo);
      CHECK(dev.device_io_unsupported().empty());
      CHECK(host.device_io_unsupported().find("host memory only") != std::string::npos);
      for (std::uint32_t l = 0; l < L.n_layers; ++l) {
        const CallRows r = make_rows(L, T, 7 + l);
        const Window::Routed routed = r.routed();
        std::vector<float> want(r.x.size()), got(r.x.size(), -1.0f);
        host.moe_routed(l, r.x.data(), Window::XType::F32, T, routed, want.data());
        seen.clear();
        dev.moe_routed_device(l, r.x.data(), T, routed, got.data());
        CHECK(std::memcmp(got.data(), want.data(), got.size() * 4) == 0);
        // Set per chunk at its first row, cleared after it, nothing else.
        std::vector<HostAsDeviceBackend::Seen> expect;
        for (std::uint32_t r0 = 0; r0 < T; r0 += wo.max_rows) {
          expect.push_back({r.x.data() + std::size_t(r0) * H, got.data() + std::size_t(r0) * H});
          expect.push_back({nullptr, nullptr});
        }
        REQUIRE(seen.size() == expect.size());
        for (std::size_t i = 0; i < seen.size(); ++i) {
          CHECK(seen[i].x == expect[i].x);
          CHECK(seen[i].out == expect[i].out);
        }
      }
      REQUIRE(StreamTesting::check_invariants(stream).empty());
      // The host path of the same Window leaves the backend on its scratch.
      const CallRows r = make_rows(L, T, 3);
      const Window::Routed routed = r.routed();
      std::vector<float> out(r.x.size());
      seen.clear();
      dev.moe_routed(0, r.x.data(), Window::XType::F32, T, routed, out.data());
      CHECK(seen.empty());
      dev.end_turn();
    }
  }
}

TEST_CASE("window: moe_routed_device refusals name their cause and leave the stream usable") {
  TestGeometry g;
  g.n_layers = 2;
  g.n_experts = 8;
  g.top_k = 2;
  auto path = build_test_pack(g, "device_io_refusals");
  PackLayout L = read_pack_layout(path);
  ExpertStream stream(path, small_options(L.n_keys(), L, 2));
  const CallRows r = make_rows(L, 3, 1);
  const Window::Routed routed = r.routed();
  std::vector<float> out(r.x.size());
  {  // the cpu backend computes from host memory only
    Window w(stream, make_cpu_backend(1), {});
    REQUIRE_THROWS_WITH(w.moe_routed_device(0, r.x.data(), 3, routed, out.data()),
                        Catch::Contains("backend 'cpu'") &&
                            Catch::Contains("host memory only"));
    CHECK(!w.in_turn());
  }
  std::vector<HostAsDeviceBackend::Seen> seen;
  Window w(stream, std::make_unique<HostAsDeviceBackend>(&seen, r.x.data()), {});
  // A pointer the backend refuses is a Config error; the turn is abandoned, the io cleared.
  try {
    w.moe_routed_device(0, r.x.data(), 3, routed, out.data());
    FAIL("the refused pointer was taken");
  } catch (const EngineError& e) {
    CHECK(e.kind() == ErrorKind::Config);
    CHECK(std::string(e.what()).find("not memory of this device") != std::string::npos);
  }
  CHECK(!w.in_turn());
  std::vector<float> x2 = r.x;
  Window::Routed bad = routed;
  std::vector<std::int32_t> bad_ids = r.ids;
  bad_ids[1] = std::int32_t(L.n_experts);
  bad.ids = bad_ids.data();
  seen.clear();
  REQUIRE_THROWS_AS(w.moe_routed_device(0, x2.data(), 3, bad, out.data()), std::out_of_range);
  CHECK(seen.empty());  // checked before any chunk
  w.moe_routed_device(0, x2.data(), 3, routed, out.data());  // usable
  REQUIRE(seen.size() == 2);
  CHECK(seen.back().x == nullptr);
  w.end_turn();
  REQUIRE(StreamTesting::check_invariants(stream).empty());
}
