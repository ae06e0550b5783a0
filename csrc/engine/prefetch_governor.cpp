#include "prefetch_governor.h"

#include <algorithm>

#include "errors.h"

namespace strata {

namespace {
// Without evidence an epoch keeps gathering, but not forever: a warm arena where every
// prediction is already resident issues almost nothing, and a judgement spanning many epochs
// would mostly describe the past.
constexpr std::uint32_t kMaxGatherEpochs = 8;
}  // namespace

const char* to_string(GovernorState s) {
  switch (s) {
    case GovernorState::Open: return "open";
    case GovernorState::Throttled: return "throttled";
    case GovernorState::Closed: return "closed";
    case GovernorState::Probing: return "probing";
  }
  return "?";
}

PrefetchGovernor::PrefetchGovernor(const GovernorOptions& options) : opt_(options) {
  if (opt_.epoch == 0 || opt_.probe_cap == 0 || opt_.max_probe_epochs == 0)
    throw EngineError(ErrorKind::Config,
                      "prefetch governor: epoch, probe_cap and max_probe_epochs must be positive");
  if (!(opt_.idle_precision >= 0 && opt_.idle_precision <= 1 && opt_.busy_precision >= 0 &&
        opt_.busy_precision <= 1 && opt_.busy_fraction >= 0 && opt_.busy_fraction <= 1))
    throw EngineError(ErrorKind::Config, "prefetch governor: thresholds must lie in [0, 1]");
}

void PrefetchGovernor::start_epoch() {
  handshakes_ = 0;
  issued_ = used_ = missed_ = contended_ = 0;
}

void PrefetchGovernor::observe(const GovernorSample& s) {
  if (state_ == GovernorState::Open)
    peak_ = std::max<std::uint32_t>(peak_, std::uint32_t(std::min<std::uint64_t>(s.issued, 1u << 20)));
  ++handshakes_;
  issued_ += s.issued;
  used_ += s.used;
  missed_ += s.missed;
  contended_ += s.missed && s.contended;
  if (handshakes_ < opt_.epoch) return;

  if (state_ == GovernorState::Closed) {  // nothing was issued: only time passes
    start_epoch();
    if (++epochs_in_state_ >= opt_.closed_epochs) {
      state_ = GovernorState::Probing;
      cap_ = opt_.probe_cap;
      epochs_in_state_ = 0;
      ++probes_;
    }
    return;
  }
  if (issued_ >= opt_.min_issued) {
    judge();
    return;
  }
  if (state_ == GovernorState::Probing &&
      handshakes_ >= std::uint64_t(opt_.epoch) * opt_.max_probe_epochs) {
    cut();  // a probe that cannot even issue is not worth keeping open
    start_epoch();
  } else if (handshakes_ >= std::uint64_t(opt_.epoch) * kMaxGatherEpochs) {
    start_epoch();  // no evidence, no change
  }
}

void PrefetchGovernor::judge() {
  const double precision = std::min(1.0, double(used_) / double(issued_));
  const double busy = missed_ ? double(contended_) / double(missed_) : 0.0;
  const double bar = busy >= opt_.busy_fraction ? opt_.busy_precision : opt_.idle_precision;
  last_precision_ = precision;
  last_busy_ = busy;
  ++epochs_;
  if (precision >= bar)
    raise();
  else
    cut();
  start_epoch();
}

void PrefetchGovernor::cut() {
  ++cuts_;
  const std::uint32_t from = state_ == GovernorState::Open ? peak_ : cap_;
  const std::uint32_t next = state_ == GovernorState::Probing ? 0 : from / 2;
  epochs_in_state_ = 0;
  if (next == 0) {
    state_ = GovernorState::Closed;
    cap_ = 0;
  } else {
    state_ = GovernorState::Throttled;
    cap_ = next;
  }
}

void PrefetchGovernor::raise() {
  if (state_ == GovernorState::Open) return;
  ++raises_;
  epochs_in_state_ = 0;
  const std::uint32_t next = cap_ >= (1u << 30) ? cap_ : cap_ * 2;
  if (next >= peak_) {
    state_ = GovernorState::Open;
    cap_ = kUnlimited;
  } else {
    state_ = GovernorState::Throttled;
    cap_ = next;
  }
}

}  // namespace strata
