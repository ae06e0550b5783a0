// The backend registry and the typed capability query: a backend registered at run time by
// name (as strata_stream._cuda does through a PyCapsule) is made by name and chosen by auto
// only where it runs what the Window needs.
#include <catch2/catch.hpp>

#include <algorithm>

#include "common/errors.h"
#include "exec/backend_registry.h"
#include "exec/window.h"
#include "delegating_backend.h"
#include "stream_test_util.h"

using namespace strata;
using namespace strata::test;

namespace {

// The CPU backend under another name, without moce: a stand-in for an out-of-tree backend.
class Renamed final : public DelegatingBackend {
 public:
  explicit Renamed(unsigned threads) : DelegatingBackend(threads) {}
  std::string name() const override { return "renamed"; }
  std::optional<std::string> unsupported(const Capability& c) const override {
    if (c.moce != MoceMode::Off) return std::string("renamed: no moce");
    return inner().unsupported(c);
  }
};

std::unique_ptr<Backend> renamed_factory(const BackendOptions& o) {
  return std::make_unique<Renamed>(o.threads);
}
std::unique_ptr<Backend> other_factory(const BackendOptions& o) { return make_cpu_backend(o.threads); }

}  // namespace

TEST_CASE("registry: a backend registered at run time is made by name and by auto") {
  register_backend("renamed", &renamed_factory);
  register_backend("renamed", &renamed_factory);  // the same factory again: nothing
  REQUIRE_THROWS_AS(register_backend("renamed", &other_factory), EngineError);
  REQUIRE_THROWS_AS(register_backend("auto", &other_factory), EngineError);
  REQUIRE_THROWS_AS(register_backend("Bad Name", &other_factory), EngineError);
  const auto names = backend_names();
  REQUIRE(names.front() == "cpu");
  REQUIRE(std::find(names.begin(), names.end(), "renamed") != names.end());

  PackLayout L;
  L.weight_format = WeightFormat::F32;
  const BackendOptions o{1, {}};
  CHECK(make_backend("renamed", o)->name() == "renamed");
  CHECK(make_backend("cpu", o)->name() == "cpu");
  CHECK(make_backend("auto", o)->name() == "renamed");  // the first one that is not cpu
  MoceParams moce;
  moce.mode = MoceMode::Scale;
  const std::vector<Capability> needs = {route_capability(L, moce)};
  CHECK(make_backend("auto", o, needs)->name() == "cpu");  // renamed lacks moce: the reference
  try {
    make_backend("renamed", o, needs);
    FAIL("a named backend without a needed capability was made");
  } catch (const EngineError& e) {
    CHECK(e.kind() == ErrorKind::Config);
    CHECK(std::string(e.what()).find("renamed: no moce") != std::string::npos);
  }
  try {
    make_backend("gpu", o);
    FAIL("an unknown backend was made");
  } catch (const EngineError& e) {
    CHECK(std::string(e.what()).find("cpu") != std::string::npos);
    CHECK(std::string(e.what()).find("renamed") != std::string::npos);
  }
}

TEST_CASE("capabilities: the CPU backend runs MLX's arithmetic only where MLX computes so") {
  auto cpu = make_cpu_backend(1);
  PackLayout f32;
  f32.weight_format = WeightFormat::F32;
  CHECK_FALSE(cpu->unsupported(Capability{Op::MoeMM, &f32, Arithmetic::Float32, MoceMode::Off}));
  CHECK(cpu->unsupported(Capability{Op::MoeMM, &f32, Arithmetic::MlxBfloat16, MoceMode::Off}));
  CHECK_FALSE(cpu->unsupported(Capability{Op::Route, &f32, Arithmetic::Float32, MoceMode::Prune}));
  // A backend that declares nothing runs Float32 without moce only.
  Renamed r(1);
  CHECK(r.Backend::unsupported(Capability{Op::MoeMM, &f32, Arithmetic::MlxFloat32, MoceMode::Off}));
  CHECK(r.unsupported(Capability{Op::Route, &f32, Arithmetic::Float32, MoceMode::Scale}));
}

TEST_CASE("capabilities: a Window refuses a backend that cannot run its own route") {
  TestGeometry g;
  g.n_layers = 2;
  auto path = build_test_pack(g, "registry_window");
  PackLayout L = read_pack_layout(path);
  ExpertStream stream(path, small_options(L.n_keys(), L, 1));
  WindowOptions wo;
  wo.moce.mode = MoceMode::Scale;
  REQUIRE_THROWS_AS(Window(stream, std::make_unique<Renamed>(1), wo), EngineError);
  Window ok(stream, make_cpu_backend(1), wo);  // the stream stays usable
  std::remove(path.c_str());
}
