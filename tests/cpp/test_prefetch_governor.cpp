// PrefetchGovernor, driven by synthetic handshake samples: the rule in prefetch_governor.h,
// deterministically (no IO, no clocks).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <vector>

#include "common/errors.h"
#include "exec/popularity.h"
#include "policy/prefetch_governor.h"

using namespace strata;

namespace {

// A workload that would start `wanted` new speculative reads per handshake, of which a
// fraction `precision` is later used; the Window honours the cap. Runs one epoch.
struct Workload {
  std::uint32_t wanted = 8;
  double precision = 1.0;
  bool missed = true;
  bool contended = false;
  // Wall time of a layer call with speculation allowed / switched off (cap 0).
  std::uint64_t time_on = 0, time_off = 0;
  double carry = 0;  // fractional used reads carried between handshakes

  void epoch(PrefetchGovernor& g) {
    for (std::uint32_t h = 0; h < g.options().epoch; ++h) {
      GovernorSample s;
      s.issued = std::min(wanted, g.cap());
      carry += double(s.issued) * precision;
      s.used = std::uint64_t(std::floor(carry));
      carry -= double(s.used);
      s.missed = missed;
      s.contended = contended;
      s.wall_ns = g.cap() > 0 ? time_on : time_off;
      g.observe(s);
    }
  }
};

GovernorOptions small() {
  GovernorOptions o;
  o.epoch = 10;
  o.min_issued = 8;
  o.closed_epochs = 3;
  o.probe_cap = 2;
  o.max_probe_epochs = 2;
  o.trial_every = 0;  // precision only; the trial tests turn trials on
  return o;
}

GovernorOptions with_trials() {
  GovernorOptions o = small();
  o.trial_every = 4;
  o.trial_every_max = 16;
  o.trial_epochs = 2;
  return o;
}

// Runs epochs until the governor reaches `state`; false after a bound, so that a governor that
// never gets there fails the test instead of hanging it.
bool run_until(PrefetchGovernor& g, Workload& w, GovernorState state, int max_epochs = 64) {
  for (int i = 0; i < max_epochs && g.state() != state; ++i) w.epoch(g);
  return g.state() == state;
}

}  // namespace

TEST_CASE("the governor starts open and stays open while prefetch pays") {
  PrefetchGovernor g(small());
  CHECK(g.state() == GovernorState::Open);
  CHECK(g.cap() == PrefetchGovernor::kUnlimited);
  Workload w;
  w.precision = 0.9;
  w.contended = true;  // busy, but nearly every read is used
  for (int i = 0; i < 5; ++i) w.epoch(g);
  CHECK(g.state() == GovernorState::Open);
  CHECK(g.epochs() == 5);
  CHECK(g.cuts() == 0);
  CHECK(g.peak() == 8);
  CHECK(g.last_precision() == Approx(0.9).margin(0.02));
  CHECK(g.last_busy() == 1.0);
}

TEST_CASE("a precision collapse halves the cap down to closed") {
  PrefetchGovernor g(small());
  Workload w;
  w.epoch(g);  // paying: learns the peak (8 new reads per handshake)
  REQUIRE(g.state() == GovernorState::Open);
  w.precision = 0.0;
  w.epoch(g);
  CHECK(g.state() == GovernorState::Throttled);
  CHECK(g.cap() == 4);
  w.epoch(g);
  CHECK(g.cap() == 2);
  // At cap 2, 10 handshakes issue 20 >= min_issued: still judged every epoch.
  w.epoch(g);
  CHECK(g.cap() == 1);
  w.epoch(g);
  CHECK(g.state() == GovernorState::Closed);
  CHECK(g.cap() == 0);
  CHECK(g.cuts() == 4);
}

TEST_CASE("closed probes after closed_epochs and recovers when prefetch pays again") {
  PrefetchGovernor g(small());
  Workload w;
  w.epoch(g);
  w.precision = 0.0;
  REQUIRE(run_until(g, w, GovernorState::Closed));
  for (std::uint32_t i = 0; i + 1 < g.options().closed_epochs; ++i) {
    w.epoch(g);
    CHECK(g.state() == GovernorState::Closed);  // waiting: nothing issued, nothing judged
  }
  w.epoch(g);
  REQUIRE(g.state() == GovernorState::Probing);
  CHECK(g.cap() == 2);
  CHECK(g.probes() == 1);

  w.precision = 1.0;  // the workload changed: predictions are right again
  w.epoch(g);
  CHECK(g.state() == GovernorState::Throttled);
  CHECK(g.cap() == 4);
  w.epoch(g);
  CHECK(g.state() == GovernorState::Open);  // 8 reaches the peak
  CHECK(g.cap() == PrefetchGovernor::kUnlimited);
  CHECK(g.raises() == 2);
}

TEST_CASE("a failed probe closes again and probes again later") {
  PrefetchGovernor g(small());
  Workload w;
  w.epoch(g);
  w.precision = 0.0;
  REQUIRE(run_until(g, w, GovernorState::Probing));
  w.epoch(g);  // the probe issues 20 reads, none used
  CHECK(g.state() == GovernorState::Closed);
  for (std::uint32_t i = 0; i < g.options().closed_epochs; ++i) w.epoch(g);
  CHECK(g.state() == GovernorState::Probing);
  CHECK(g.probes() == 2);
}

TEST_CASE("the precision bar rises when urgent reads wait behind speculation") {
  Workload w;
  w.precision = 0.4;  // above the idle bar (0.25), below the busy one (0.5)
  PrefetchGovernor idle(small());
  w.contended = false;
  for (int i = 0; i < 3; ++i) w.epoch(idle);
  CHECK(idle.state() == GovernorState::Open);
  CHECK(idle.last_busy() == 0.0);

  PrefetchGovernor busy(small());
  w.contended = true;
  w.epoch(busy);
  CHECK(busy.state() == GovernorState::Throttled);
  CHECK(busy.last_busy() == 1.0);

  // Contention only counts among handshakes whose urgent reads missed.
  PrefetchGovernor hits(small());
  w.missed = false;
  w.epoch(hits);
  CHECK(hits.state() == GovernorState::Open);
  CHECK(hits.last_busy() == 0.0);
}

TEST_CASE("without enough speculative reads an epoch is not judged") {
  PrefetchGovernor g(small());
  Workload w;
  w.wanted = 0;  // e.g. every prediction already resident
  w.precision = 0.0;
  for (int i = 0; i < 20; ++i) w.epoch(g);
  CHECK(g.state() == GovernorState::Open);
  CHECK(g.epochs() == 0);
  CHECK(g.last_precision() < 0);
}

TEST_CASE("a probe that cannot issue gives up") {
  PrefetchGovernor g(small());
  Workload w;
  w.epoch(g);
  w.precision = 0.0;
  REQUIRE(run_until(g, w, GovernorState::Probing));
  w.wanted = 0;
  for (std::uint32_t i = 0; i < g.options().max_probe_epochs; ++i) {
    CHECK(g.state() == GovernorState::Probing);
    w.epoch(g);
  }
  CHECK(g.state() == GovernorState::Closed);
}

TEST_CASE("the governor rejects options it cannot work with") {
  GovernorOptions o = small();
  CHECK_NOTHROW(PrefetchGovernor(o));
  o.epoch = 0;
  CHECK_THROWS_AS(PrefetchGovernor(o), EngineError);
  o = small();
  o.busy_precision = 1.5;
  CHECK_THROWS_AS(PrefetchGovernor(o), EngineError);
}

TEST_CASE("a trial closes prefetch that is right but makes layer calls slower") {
  PrefetchGovernor g(with_trials());
  Workload w;
  w.precision = 0.9;  // precision alone would keep it open...
  w.contended = true;
  w.time_on = 1500;   // ...but layer calls take 50% longer with it (busy SSD)
  w.time_off = 1000;
  for (int i = 0; i < 4; ++i) {
    CHECK(g.state() == GovernorState::Open);
    w.epoch(g);
  }
  REQUIRE(g.state() == GovernorState::Trial);
  // Arms off, on, on, off: one epoch each.
  const std::uint32_t caps[] = {0, PrefetchGovernor::kUnlimited, PrefetchGovernor::kUnlimited, 0};
  for (std::uint32_t cap : caps) {
    CHECK(g.state() == GovernorState::Trial);
    CHECK(g.cap() == cap);
    w.epoch(g);
  }
  CHECK(g.state() == GovernorState::Closed);
  CHECK(g.trials() == 1);
  CHECK(g.cuts() == 1);
  CHECK(g.last_wall_on() == Approx(1500));
  CHECK(g.last_wall_off() == Approx(1000));
  // A failed trial doubles how long Closed lasts: 2 * closed_epochs before the next probe.
  for (std::uint32_t i = 0; i + 1 < 2 * g.options().closed_epochs; ++i) {
    w.epoch(g);
    CHECK(g.state() == GovernorState::Closed);
  }
  w.epoch(g);
  CHECK(g.state() == GovernorState::Probing);
}

TEST_CASE("a trial keeps prefetch that saves time and spaces the next one out") {
  PrefetchGovernor g(with_trials());
  Workload w;
  w.precision = 0.9;
  w.time_on = 500;
  w.time_off = 1000;
  for (int i = 0; i < 4 + 4; ++i) w.epoch(g);  // 4 open epochs, then the 4-arm trial
  CHECK(g.state() == GovernorState::Open);
  CHECK(g.trials() == 1);
  CHECK(g.cuts() == 0);
  CHECK(g.last_wall_on() == Approx(500));
  for (int i = 0; i < 7; ++i) {
    w.epoch(g);
    CHECK(g.state() == GovernorState::Open);  // the next trial waits 8 epochs, not 4
  }
  w.epoch(g);
  CHECK(g.state() == GovernorState::Trial);
}

TEST_CASE("a trial tolerates noise within the margin") {
  PrefetchGovernor g(with_trials());
  Workload w;
  w.precision = 0.9;
  w.time_on = 1050;  // 5% slower: under the 10% margin
  w.time_off = 1000;
  for (int i = 0; i < 8; ++i) w.epoch(g);
  CHECK(g.trials() == 1);
  CHECK(g.state() == GovernorState::Open);
}

TEST_CASE("prompt handshakes add no time to a trial") {
  PrefetchGovernor g(with_trials());
  Workload w;
  w.precision = 0.9;
  w.time_on = 1500;
  w.time_off = 1000;
  for (int i = 0; i < 4; ++i) w.epoch(g);
  REQUIRE(g.state() == GovernorState::Trial);
  REQUIRE(g.cap() == 0);
  GovernorSample prompt;
  prompt.decode = false;
  prompt.wall_ns = 1000000;  // a huge prompt chunk in an off arm must not decide the trial
  // Fewer than the arm's bound (trial_arm_max epochs' worth): the off arm keeps running.
  for (int i = 0; i < 15; ++i) g.observe(prompt);
  CHECK(g.state() == GovernorState::Trial);
  CHECK(g.cap() == 0);
  for (int i = 0; i < 4; ++i) w.epoch(g);
  CHECK(g.state() == GovernorState::Closed);
  CHECK(g.trials() == 1);
  CHECK(g.last_wall_off() == Approx(1000));  // the prompts' 1 ms is nowhere
  CHECK(g.last_wall_on() == Approx(1500));
}

TEST_CASE("a prompt-only workload cannot hold a trial's off arm forever") {
  const GovernorOptions o = with_trials();
  PrefetchGovernor g(o);
  Workload w;
  w.precision = 0.9;
  for (int i = 0; i < 4; ++i) w.epoch(g);
  REQUIRE(g.state() == GovernorState::Trial);
  REQUIRE(g.cap() == 0);
  // From here on only prompt chunks: no decode time ever arrives. Each arm ends after
  // trial_arm_max epochs' worth of handshakes; with no decode call to compare the trial is
  // abandoned and speculation is back on.
  GovernorSample prompt;
  prompt.decode = false;
  prompt.issued = 4;
  prompt.used = 4;
  const std::uint32_t bound = 2 * o.trial_epochs * o.trial_arm_max * o.epoch;
  std::uint32_t n = 0;
  while (g.state() == GovernorState::Trial && n < 10 * bound) {
    g.observe(prompt);
    ++n;
  }
  CHECK(n == bound);
  CHECK(g.state() == GovernorState::Open);
  CHECK(g.cap() == PrefetchGovernor::kUnlimited);
  CHECK(g.trials() == 0);
  CHECK(g.abandoned_trials() == 1);
  // Prompt traffic alone starts no new trial (trials count decode handshakes Open).
  for (std::uint32_t i = 0; i < 10 * bound; ++i) g.observe(prompt);
  CHECK(g.state() == GovernorState::Open);
  // Decode traffic resumes: trials resume, and a verdict is reached again.
  w.time_on = 1500;
  w.time_off = 1000;
  CHECK(run_until(g, w, GovernorState::Closed, 16));
  CHECK(g.trials() == 1);
}

TEST_CASE("deterministic mode: the cap ignores wall time and contention, and runs no trial") {
  GovernorOptions o = with_trials();
  o.deterministic = true;
  // Two governors fed the same speculative counts, missing pattern and decode flags but
  // wildly different timing and contention must produce the same cap at every handshake.
  PrefetchGovernor a(o), b(o);
  std::uint64_t seed = 12345;
  auto next = [&] {
    seed ^= seed << 13;
    seed ^= seed >> 7;
    seed ^= seed << 17;
    return seed;
  };
  int phase_changes = 0;
  GovernorState last = a.state();
  for (int h = 0; h < 4000; ++h) {
    GovernorSample s;
    // Precision drifts between good and bad so that the governor moves through its states.
    const bool good = (h / 300) % 2 == 0;
    s.issued = std::min<std::uint64_t>(1 + next() % 6, a.cap());
    s.used = good ? s.issued : (next() % 4 == 0 ? s.issued : 0);
    s.missed = next() % 3 != 0;
    s.decode = next() % 5 != 0;
    GovernorSample t = s;
    s.wall_ns = next() % 1000000;
    s.contended = next() % 2;
    t.wall_ns = next() % 7;
    t.contended = !s.contended;
    a.observe(s);
    b.observe(t);
    REQUIRE(a.cap() == b.cap());
    REQUIRE(a.state() == b.state());
    REQUIRE(a.state() != GovernorState::Trial);
    if (a.state() != last) ++phase_changes;
    last = a.state();
  }
  CHECK(phase_changes > 2);  // the sequence was not trivially constant
  CHECK(a.trials() == 0);
  // Busy bar always: precision 0.4 (between idle 0.25 and busy 0.5) is cut even uncontended.
  PrefetchGovernor c(o);
  Workload w;
  w.precision = 0.4;
  w.contended = false;
  CHECK(run_until(c, w, GovernorState::Closed, 32));
}


// ---- the per-layer gate -----------------------------------------------------------------------

namespace {

// Decode over `precision.size()` layers: the handshake of layer l starts up to `wanted` reads
// for layer l + 1 (as its cap allows), and the handshake of l + 1 uses a fraction precision[l+1]
// of them. Returns the fraction of started reads never used, over `tokens` tokens.
struct Layered {
  std::vector<double> precision;
  std::uint32_t wanted = 4;
  std::uint64_t issued_total = 0, used_total = 0;
  std::vector<double> carry;

  double run(PrefetchGovernor& g, std::uint32_t tokens) {
    const std::uint32_t L = std::uint32_t(precision.size());
    carry.resize(L, 0);
    std::vector<std::uint32_t> pending(L, 0);  // reads started for each layer, not yet judged
    std::uint64_t issued0 = issued_total, used0 = used_total;
    for (std::uint32_t t = 0; t < tokens; ++t)
      for (std::uint32_t l = 0; l < L; ++l) {
        GovernorSample s;
        s.layer = l;
        s.missed = true;
        s.contended = true;
        carry[l] += double(pending[l]) * precision[l];
        s.used = std::uint64_t(std::floor(carry[l]));
        carry[l] -= double(s.used);
        pending[l] = 0;
        if (l + 1 < L) {
          s.issued = std::min(wanted, g.cap_for(l));
          pending[l + 1] = std::uint32_t(s.issued);
        }
        issued_total += s.issued;
        used_total += s.used;
        g.observe(s);
      }
    const double issued = double(issued_total - issued0);
    return issued > 0 ? 1.0 - double(used_total - used0) / issued : 0.0;
  }
};

GovernorOptions gate_only(double layer_precision) {
  GovernorOptions o;
  o.epoch = 8;                // one token of 8 layers
  o.min_issued = 1u << 30;    // the global rule never judges: the gate alone
  o.trial_every = 0;
  o.layer_precision = layer_precision;
  return o;
}

}  // namespace

TEST_CASE("the per-layer gate stops the layers whose predictions are mostly wrong") {
  // Half the layers predicted well, half badly: about 40% of the reads unused without a gate.
  Layered w;
  w.precision = {1.0, 0.9, 0.3, 0.95, 0.2, 0.9, 0.4, 0.85};
  PrefetchGovernor off(gate_only(0));
  Layered control = w;
  const double unused_without = control.run(off, 200);
  CHECK(unused_without > 0.3);
  CHECK(off.layer_gates() == 0);

  PrefetchGovernor g(gate_only(0.75));
  const double unused = w.run(g, 200);
  CHECK(unused <= 0.25);
  CHECK(g.layer_gates() > 0);
  for (std::uint32_t l : {2u, 4u, 6u}) {  // gated, or probing on one read a handshake
    CHECK(g.layer_cap(l) <= 1);
    CHECK(g.cap_for(l - 1) <= 1);
  }
  for (std::uint32_t l : {1u, 3u, 5u, 7u}) {
    CHECK_FALSE(g.layer_gated(l));
    CHECK(g.cap_for(l - 1) == PrefetchGovernor::kUnlimited);
    CHECK(g.layer_precision(l) >= 0.75);
  }
  // Gated layers are measured again now and then, each failure gating them longer, so the
  // wasted probes thin out: far fewer gates than one per bad layer every gate_epochs tokens.
  CHECK(g.layer_gates() < 3 * 200 / 8);
}

TEST_CASE("a gated layer whose predictions become right speculates again") {
  Layered w;
  w.precision = {1.0, 1.0, 0.2, 1.0};
  GovernorOptions o = gate_only(0.75);
  o.epoch = 4;
  PrefetchGovernor g(o);
  w.run(g, 20);
  REQUIRE(g.layer_cap(2) <= 1);
  w.precision[2] = 0.95;
  w.run(g, 200);  // the gate ends within closed_epochs_max tokens and the next judgement passes
  CHECK_FALSE(g.layer_gated(2));
  CHECK(g.cap_for(1) == PrefetchGovernor::kUnlimited);
  CHECK(g.layer_precision(2) >= 0.75);
}

TEST_CASE("samples without a layer leave the gate alone, and layer_precision is checked") {
  PrefetchGovernor g(gate_only(0.75));
  GovernorSample s;
  s.issued = 100;
  s.used = 0;
  for (int i = 0; i < 20; ++i) g.observe(s);
  CHECK(g.layer_gates() == 0);
  CHECK(g.cap_for(0) == PrefetchGovernor::kUnlimited);
  CHECK(g.layer_precision(1) == -1);
  GovernorOptions bad = gate_only(1.5);
  CHECK_THROWS_AS(PrefetchGovernor(bad), EngineError);
}

TEST_CASE("Predictions rank ties in the router's order, so a per-layer cap reads the likeliest",
          "[governor]") {
  Popularity p(8);
  std::vector<std::int32_t> out;
  // One decode row: router top-k best first; every expert chosen once.
  const std::vector<std::int32_t> row = {6, 1, 4, 3};
  p.rank(row.data(), std::uint32_t(row.size()), out, Popularity::Ties::Given);
  CHECK(out == std::vector<std::int32_t>{6, 1, 4, 3});
  // More votes still come first; the urgent order (ties to the lower id) is unchanged.
  const std::vector<std::int32_t> rows = {6, 1, 4, 1, 3, 6};
  p.rank(rows.data(), std::uint32_t(rows.size()), out, Popularity::Ties::Given);
  CHECK(out == std::vector<std::int32_t>{6, 1, 4, 3});
  p.rank(rows.data(), std::uint32_t(rows.size()), out);
  CHECK(out == std::vector<std::int32_t>{1, 6, 3, 4});
}
