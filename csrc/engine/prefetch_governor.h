// PrefetchGovernor: backs speculative reads off when they do not pay (DESIGN.md section 6).
//
// Speculative reads yield to urgent ones in the IO queue (I9), but once a speculative part is
// being read it shares the SSD with the urgent parts behind it; public measurements show
// next-layer prefetch costing 13-38% wall clock on an already busy SSD. The Window feeds the
// governor one Sample per handshake and asks it, before queueing speculation, how many new
// speculative reads it may start (cap()).
//
// The rule, judged once per epoch (`epoch` handshakes holding at least `min_issued` speculative
// reads, so a judgement rests on evidence):
//   precision p = speculative reads an urgent request later used / speculative reads started;
//   busy        = among handshakes whose urgent reads missed, the fraction during whose wait
//                 speculative parts were in flight is >= busy_fraction;
//   pays        = p >= (busy ? busy_precision : idle_precision).
// On a busy SSD a wasted read delays urgent work by about one record read and a used one saves
// at most about one (it is the same read, moved earlier), so break-even is p = 1/2. On an idle
// SSD a wasted read costs only a slot and idle bandwidth; the lower bar still stops a
// prediction that is mostly noise.
//
// States (the cap in brackets):
//   Open [unlimited] --not paying--> Throttled [peak/2] --not paying--> ... halving ...
//   Throttled [1] --not paying--> Closed [0] --closed_epochs epochs--> Probing [probe_cap]
//   Probing --pays--> Throttled [2 * probe_cap] --pays--> ... doubling ... --> Open
//   Probing --not paying (or no evidence within max_probe_epochs)--> Closed
// `peak` is the most new speculative reads one handshake started while Open: the cap starts
// from what the unthrottled policy actually issues, for decode (a few) and prompt (many) alike.
//
// Not thread-safe: the Window's host thread owns it (every Window method runs on one thread).
#pragma once

#include <cstdint>
#include <string>

namespace strata {

enum class GovernorState : std::uint8_t { Open, Throttled, Closed, Probing };

const char* to_string(GovernorState s);

struct GovernorOptions {
  // Handshakes per judgement. The Window turns 0 into n_layers: one decode token, so every
  // layer's prediction weighs the same in a judgement.
  std::uint32_t epoch = 0;
  std::uint32_t min_issued = 16;     // speculative reads an epoch needs before it is judged
  double idle_precision = 0.25;
  double busy_precision = 0.5;
  double busy_fraction = 0.5;
  std::uint32_t closed_epochs = 4;   // epochs of silence before a probe: probing costs <= 1/5
  std::uint32_t probe_cap = 2;       // new speculative reads per handshake while probing
  std::uint32_t max_probe_epochs = 4;  // a probe that gathers no evidence gives up
};

// One handshake as the governor sees it. `issued` and `used` are deltas of the stream's
// counters (spec_requests, spec_hits) since the previous sample; `used` may count reads issued
// in an earlier epoch, so precision is clamped to 1.
struct GovernorSample {
  std::uint64_t issued = 0;
  std::uint64_t used = 0;
  bool missed = false;     // the handshake's urgent reads had to come from the SSD
  bool contended = false;  // ...and speculative parts were in flight while the host waited
};

class PrefetchGovernor {
 public:
  static constexpr std::uint32_t kUnlimited = 0xFFFFFFFFu;

  explicit PrefetchGovernor(const GovernorOptions& options = {});

  // New speculative reads the next handshake may start (kUnlimited while Open).
  std::uint32_t cap() const { return cap_; }
  GovernorState state() const { return state_; }
  void observe(const GovernorSample& s);

  // Reporting.
  std::uint32_t peak() const { return peak_; }
  std::uint64_t epochs() const { return epochs_; }  // judgements made
  std::uint64_t cuts() const { return cuts_; }
  std::uint64_t raises() const { return raises_; }
  std::uint64_t probes() const { return probes_; }
  double last_precision() const { return last_precision_; }  // -1 before the first judgement
  double last_busy() const { return last_busy_; }            // -1 before the first judgement
  const GovernorOptions& options() const { return opt_; }

 private:
  void judge();
  void cut();
  void raise();
  void start_epoch();

  GovernorOptions opt_;
  GovernorState state_ = GovernorState::Open;
  std::uint32_t cap_ = kUnlimited;
  std::uint32_t peak_ = 1;  // most new reads one handshake started while Open

  // The epoch being gathered.
  std::uint32_t handshakes_ = 0;
  std::uint32_t epochs_in_state_ = 0;  // Closed: epochs waited; Probing: epochs probed
  std::uint64_t issued_ = 0, used_ = 0, missed_ = 0, contended_ = 0;

  std::uint64_t epochs_ = 0, cuts_ = 0, raises_ = 0, probes_ = 0;
  double last_precision_ = -1, last_busy_ = -1;
};

}  // namespace strata
