// The host's spin before it blocks on a handshake (exec/adaptive_spin.h): spins while the device
// answers within the budget, stops when answers take longer, probes one wait in 16 and comes
// back when answers are short again. A wait that is never ready blocks; no budget, no spin.
// The spin reads a clock the test moves itself: each look at it passes a microsecond, and a
// blocked wait passes its answer time, so no descheduling of the test's thread (a loaded
// machine, a sanitizer) can change what a wait measures.
#include <catch2/catch.hpp>

#include <chrono>
#include <cstdint>

#include "exec/adaptive_spin.h"

using namespace std::chrono_literals;

namespace {

struct StepClock {
  using duration = std::chrono::nanoseconds;
  using rep = duration::rep;
  using period = duration::period;
  using time_point = std::chrono::time_point<StepClock>;
  static constexpr bool is_steady = true;
  static inline std::int64_t ns = 0;
  static time_point now() {
    ns += 1000;  // each look passes a microsecond
    return time_point(duration(ns));
  }
  static void pass(std::chrono::microseconds d) { ns += std::chrono::nanoseconds(d).count(); }
};

using AdaptiveSpin = strata::BasicAdaptiveSpin<StepClock>;

struct Counts {
  int spun = 0;     // waits that looked at ready() at all
  int blocked = 0;  // waits that called block()
};

// `answer_after`: how long block() takes; ready() is true at once when `instant`.
Counts run(AdaptiveSpin& spin, int waits, bool instant, std::chrono::microseconds answer_after) {
  Counts c;
  for (int i = 0; i < waits; ++i) {
    bool looked = false;
    const bool ok = spin.wait(
        [&] {
          looked = true;
          return instant;
        },
        [&] {
          ++c.blocked;
          StepClock::pass(answer_after);
          return true;
        });
    REQUIRE(ok);
    c.spun += looked ? 1 : 0;
  }
  return c;
}

}  // namespace

TEST_CASE("adaptive spin: short answers keep the spin, and no wait blocks", "[spin]") {
  AdaptiveSpin spin(50us);
  const Counts c = run(spin, 200, /*instant=*/true, 0us);
  CHECK(c.spun == 200);
  CHECK(c.blocked == 0);
  CHECK(spin.worth_spinning());
}

TEST_CASE("adaptive spin: long answers stop the spin except one probe in 16", "[spin]") {
  AdaptiveSpin spin(50us);
  run(spin, 8, /*instant=*/false, 1000us);  // answers at 1 ms: the estimate passes the budget
  REQUIRE_FALSE(spin.worth_spinning());
  const Counts c = run(spin, 160, /*instant=*/false, 200us);
  CHECK(c.blocked == 160);
  CHECK(c.spun <= 160 / 16 + 1);  // the probes only
  CHECK(c.spun >= 160 / 16 - 1);
  CHECK_FALSE(spin.worth_spinning());
}

TEST_CASE("adaptive spin: the probes bring the spin back once answers are short", "[spin]") {
  AdaptiveSpin spin(50us);
  run(spin, 8, /*instant=*/false, 1000us);
  REQUIRE_FALSE(spin.worth_spinning());
  // Each probe sees an instant answer and pulls the estimate down by a quarter of the way; a
  // few hundred waits hold enough probes even if a probe is descheduled once or twice.
  const Counts c = run(spin, 1000, /*instant=*/true, 0us);
  CHECK(spin.worth_spinning());
  CHECK(c.spun > 1000 / 2);  // spinning again for most of the run
}

TEST_CASE("adaptive spin: a zero budget never spins", "[spin]") {
  AdaptiveSpin spin(0us);
  const Counts c = run(spin, 40, /*instant=*/true, 0us);
  CHECK(c.spun == 0);
  CHECK(c.blocked == 40);
  CHECK_FALSE(spin.worth_spinning());
}
