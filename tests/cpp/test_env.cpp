// common/env.h, the one reader of the environment in C++, and the one range check of every
// setting (validate(StreamOptions), WindowOptions::validate): each refusal names what was wrong.
#include <catch2/catch.hpp>

#include <cstdlib>
#include <string>

#include "common/env.h"
#include "common/errors.h"
#include "exec/window_options.h"

using namespace strata;

namespace {

// Sets one variable for a scope, and unsets it after.
struct ScopedEnv {
  const char* name;
  ScopedEnv(const char* n, const char* value) : name(n) { ::setenv(n, value, 1); }
  ~ScopedEnv() { ::unsetenv(name); }
};

const char* kVar = "STRATA_TEST_ENV_SETTING";

// The message of the EngineError(Config) that `f` throws ("" when it throws none).
template <class F>
std::string config_error(F f) {
  try {
    f();
  } catch (const EngineError& e) {
    REQUIRE(e.kind() == ErrorKind::Config);
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("env: unset and empty variables take the fallback", "[env]") {
  ::unsetenv(kVar);
  CHECK_FALSE(env::text(kVar));
  CHECK_FALSE(env::present(kVar));
  CHECK(env::flag(kVar, true));
  CHECK(env::integer(kVar, 7, 0, 10, "things") == 7);
  CHECK(env::choice(kVar, {"a", "b"}) == 0);
  ScopedEnv empty(kVar, "");
  CHECK(env::present(kVar));  // a trace switch: set, whatever its text
  CHECK_FALSE(env::text(kVar));
  CHECK_FALSE(env::flag(kVar, false));
}

TEST_CASE("env: values are parsed, and a bad one names the variable", "[env]") {
  {
    ScopedEnv on(kVar, "On");
    CHECK(env::flag(kVar, false));
  }
  {
    ScopedEnv off(kVar, "0");
    CHECK_FALSE(env::flag(kVar, true));
  }
  {
    ScopedEnv maybe(kVar, "maybe");
    CHECK(config_error([] { env::flag(kVar, true); }) ==
          "STRATA_TEST_ENV_SETTING must be 0/1/true/false, got 'maybe'");
  }
  {
    ScopedEnv n(kVar, "42");
    CHECK(env::integer(kVar, 0, 0, 100, "KiB") == 42);
    CHECK(config_error([] { env::integer(kVar, 0, 0, 10, "KiB"); }) ==
          "STRATA_TEST_ENV_SETTING must be KiB in 0..10, got '42'");
  }
  {
    ScopedEnv n(kVar, "1M");
    CHECK(config_error([] { env::integer(kVar, 0, 0, 1 << 20, "KiB"); }) ==
          "STRATA_TEST_ENV_SETTING must be KiB in 0..1048576, got '1M'");
  }
  {
    ScopedEnv c(kVar, "completion");
    CHECK(env::choice(kVar, {"parts", "completion"}) == 1);
    CHECK(config_error([] { env::choice(kVar, {"auto", "mma", "wgmma"}); }) ==
          "STRATA_TEST_ENV_SETTING must be auto, mma or wgmma, got 'completion'");
  }
}

TEST_CASE("validate: every stream setting out of range is refused by name", "[env][options]") {
  CHECK(config_error([] { validate(StreamOptions{}); }).empty());
  const auto refused = [](auto change) {
    StreamOptions o;
    change(o);
    return config_error([&] { validate(o); });
  };
  CHECK(refused([](StreamOptions& o) { o.arena_bytes = 0; }) == "arena_bytes must be positive");
  CHECK(refused([](StreamOptions& o) { o.io_threads = 257; }).rfind("io_threads must be 0..256", 0) ==
        0);
  CHECK(refused([](StreamOptions& o) { o.part_bytes = 1000; })
            .rfind("part_bytes must be a positive multiple of", 0) == 0);
  CHECK(refused([](StreamOptions& o) { o.io_spin_us = 100001; })
            .rfind("io_spin_us must be 0..100000", 0) == 0);
  CHECK(refused([](StreamOptions& o) { o.io_timeout_s = 0; }) ==
        "io_timeout_s must be positive and finite, got 0");
}

TEST_CASE("validate: every window setting out of range is refused by name", "[env][options]") {
  CHECK(config_error([] { WindowOptions{}.validate(); }).empty());
  const auto refused = [](auto change) {
    WindowOptions o;
    change(o);
    return config_error([&] { o.validate(); });
  };
  CHECK(refused([](WindowOptions& o) { o.max_rows = 0; }) == "max_rows must be positive");
  CHECK(refused([](WindowOptions& o) { o.device_timeout_s = -1; }) ==
        "device_timeout_s must be positive and finite, got -1");
  CHECK(refused([](WindowOptions& o) { o.two_layer_max = kTwoLayerMaxLimit + 1; }) ==
        "two_layer_max must be 0..512, got 513");
  CHECK(refused([](WindowOptions& o) { o.moce.strength = -0.5f; }) ==
        "moce_strength must be finite and >= 0, got -0.5");
}
