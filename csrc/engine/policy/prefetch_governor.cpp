#include "policy/prefetch_governor.h"

#include <algorithm>
#include <cmath>

#include "common/errors.h"

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
    case GovernorState::Trial: return "trial";
  }
  return "?";
}

PrefetchGovernor::PrefetchGovernor(const GovernorOptions& options)
    : opt_(options), trial_every_(options.trial_every), closed_for_(options.closed_epochs) {
  if (opt_.epoch == 0 || opt_.probe_cap == 0 || opt_.max_probe_epochs == 0 ||
      (opt_.trial_every > 0 && (opt_.trial_epochs == 0 || opt_.trial_arm_max == 0)))
    throw EngineError(ErrorKind::Config,
                      "prefetch governor: epoch, probe_cap, max_probe_epochs and (with trials) "
                      "trial_epochs and trial_arm_max must be positive");
  if (opt_.deterministic) trial_every_ = 0;  // trials compare wall time
  if (!(opt_.trial_margin >= 0))
    throw EngineError(ErrorKind::Config, "prefetch governor: trial_margin must be >= 0");
  if (!(opt_.idle_precision >= 0 && opt_.idle_precision <= 1 && opt_.busy_precision >= 0 &&
        opt_.busy_precision <= 1 && opt_.busy_fraction >= 0 && opt_.busy_fraction <= 1 &&
        opt_.layer_precision >= 0 && opt_.layer_precision <= 1 && opt_.rank_precision >= 0 &&
        opt_.rank_precision <= 1 && opt_.rank_decay > 0 && opt_.rank_decay <= 1))
    throw EngineError(ErrorKind::Config, "prefetch governor: thresholds and rank_decay must lie in [0, 1] (rank_decay above 0)");
}

void PrefetchGovernor::start_epoch() {
  handshakes_ = 0;
  issued_ = used_ = missed_ = contended_ = 0;
}

void PrefetchGovernor::open() {
  state_ = GovernorState::Open;
  cap_ = kUnlimited;
  on_handshakes_ = 0;
}

// Arm i of a trial runs without speculation when i % 4 is 0 or 3: off, on, on, off, ...
// (ABBA), so a load that drifts linearly over the trial weighs both arms the same.
static bool arm_is_off(std::uint32_t i) { return i % 4 == 0 || i % 4 == 3; }

void PrefetchGovernor::begin_trial() {
  state_ = GovernorState::Trial;
  arm_ = 0;
  arm_decode_ = arm_handshakes_ = 0;
  cap_ = 0;
  for (auto& a : arm_wall_) a = {0, 0};
  start_epoch();
}

void PrefetchGovernor::trial_sample(const GovernorSample& s) {
  if (s.decode) {  // only decode time is compared
    auto& a = arm_wall_[arm_is_off(arm_) ? 0 : 1];
    a.first += s.wall_ns;
    ++a.second;
    ++arm_decode_;
  }
  ++arm_handshakes_;
  // Any handshake counts toward the arm's length: prompt-only traffic ends it too.
  if (arm_decode_ < opt_.epoch &&
      arm_handshakes_ < std::uint64_t(opt_.epoch) * opt_.trial_arm_max)
    return;
  arm_decode_ = arm_handshakes_ = 0;
  if (++arm_ < 2 * opt_.trial_epochs)
    cap_ = arm_is_off(arm_) ? 0 : kUnlimited;
  else
    end_trial();
}

void PrefetchGovernor::end_trial() {
  start_epoch();
  if (arm_wall_[0].second == 0 || arm_wall_[1].second == 0) {
    ++abandoned_trials_;  // an arm kind saw no decode call: nothing to compare
    open();
    return;
  }
  ++trials_;
  auto mean = [](const std::pair<std::uint64_t, std::uint64_t>& a) {
    return double(a.first) / double(std::max<std::uint64_t>(a.second, 1));
  };
  last_wall_off_ = mean(arm_wall_[0]);
  last_wall_on_ = mean(arm_wall_[1]);
  if (last_wall_on_ > last_wall_off_ * (1 + opt_.trial_margin)) {
    ++cuts_;  // speculation costs more time than it hides: off, probe again later
    state_ = GovernorState::Closed;
    cap_ = 0;
    epochs_in_state_ = 0;
    trial_every_ = opt_.trial_every;
    closed_for_ = std::min(opt_.closed_epochs_max, std::max(closed_for_ * 2, 1u));
  } else {
    trial_every_ = std::min(opt_.trial_every_max, trial_every_ * 2);
    closed_for_ = opt_.closed_epochs;
    open();
  }
}

double PrefetchGovernor::layer_precision(std::uint32_t layer) const {
  return layer < layers_.size() ? layers_[layer].last : -1;
}

void PrefetchGovernor::observe_layer(const GovernorSample& s) {
  if (s.layer == GovernorSample::kNoLayer || opt_.layer_precision <= 0) return;
  if (layers_.size() < std::size_t(s.layer) + 2) layers_.resize(std::size_t(s.layer) + 2);
  // What this handshake started is for the next layer; it is judged at that layer's handshake,
  // once its urgent requests have had the chance to use it.
  LayerEvidence& next = layers_[s.layer + 1];
  if (next.gated_for == 0) {
    next.issued += double(s.issued);
    next.peak = std::max<std::uint32_t>(next.peak, std::uint32_t(std::min<std::uint64_t>(s.issued, 1u << 20)));
    ++next.handshakes;
  }
  LayerEvidence& here = layers_[s.layer];
  if (here.gated_for > 0) {  // a gate lasts this layer's handshakes: one per token in decode
    if (--here.gated_for == 0) {
      here.issued = here.used = 0;
      here.handshakes = 0;
      here.cap = 1;  // measured afresh on its best prediction alone
      here.regated = true;
    }
    return;
  }
  here.used += double(s.used);
  // A probe after a gate is judged on a quarter of the evidence: it reads one prediction a
  // handshake, and a layer that failed before is most likely to fail again.
  const std::uint32_t needed = here.regated ? std::max(opt_.layer_min_issued / 4, 1u)
                                            : opt_.layer_min_issued;
  if (here.issued < needed) return;
  const double p = std::min(1.0, here.used / here.issued);
  here.last = p;
  const std::uint32_t typical = std::uint32_t(std::min<double>(
      std::ceil(here.issued / std::max<std::uint32_t>(here.handshakes, 1)), double(1u << 20)));
  here.issued = here.used = 0;
  here.handshakes = 0;
  if (p < opt_.layer_precision) {
    // A lower cap reads only the likeliest predictions (the Window queues them best first).
    const std::uint32_t from = here.cap == kUnlimited ? typical : here.cap;
    if (from > 1) {
      here.cap = from / 2;
      return;
    }
    ++layer_gates_;
    const std::uint32_t base = std::max(opt_.layer_gated_epochs, 1u);
    const std::uint32_t longest = std::max(opt_.closed_epochs_max, base);
    here.gate_epochs = here.regated ? std::min(longest, std::max(base, here.gate_epochs * 2)) : base;
    here.gated_for = here.gate_epochs;
    here.cap = 0;
    here.regated = false;
    return;
  }
  here.regated = false;
  // Raised only with room to spare: a cap that doubles whenever it just passes would spend
  // every other judgement above the bar's waste.
  if (here.cap != kUnlimited && p >= opt_.layer_precision + (1 - opt_.layer_precision) / 2)
    here.cap = here.cap * 2 >= here.peak ? kUnlimited : here.cap * 2;
}

void PrefetchGovernor::observe_start(std::uint32_t layer, std::uint64_t issued) {
  if (opt_.layer_precision <= 0) return;
  if (layers_.size() < std::size_t(layer) + 2) layers_.resize(std::size_t(layer) + 2);
  LayerEvidence& e = layers_[layer];
  if (e.gated_for > 0) return;
  e.issued += double(issued);
  e.peak = std::max<std::uint32_t>(e.peak, std::uint32_t(std::min<std::uint64_t>(issued, 1u << 20)));
}

void PrefetchGovernor::observe_rank(std::uint32_t layer, std::uint32_t rank, bool chosen) {
  if (opt_.rank_precision <= 0) return;
  if (ranks_.size() <= layer) ranks_.resize(std::size_t(layer) + 1);
  auto& row = ranks_[layer];
  if (row.size() <= rank) row.resize(std::size_t(rank) + 1);
  RankEvidence& e = row[rank];
  e.trials = e.trials * opt_.rank_decay + 1;
  e.chosen = e.chosen * opt_.rank_decay + (chosen ? 1 : 0);
  ++e.seen;
}

bool PrefetchGovernor::rank_gated(std::uint32_t layer, std::uint32_t rank) const {
  if (opt_.rank_precision <= 0 || layer >= ranks_.size() || rank >= ranks_[layer].size())
    return false;
  const RankEvidence& e = ranks_[layer][rank];
  return e.seen >= opt_.rank_min_trials && e.chosen < opt_.rank_precision * e.trials;
}

double PrefetchGovernor::rank_precision(std::uint32_t layer, std::uint32_t rank) const {
  if (layer >= ranks_.size() || rank >= ranks_[layer].size()) return -1;
  const RankEvidence& e = ranks_[layer][rank];
  return e.seen ? e.chosen / e.trials : -1;
}

void PrefetchGovernor::observe(const GovernorSample& s) {
  observe_layer(s);
  if (state_ == GovernorState::Trial) {  // precision waits; see trial_sample
    trial_sample(s);
    return;
  }
  if (state_ == GovernorState::Open) {
    peak_ = std::max<std::uint32_t>(peak_, std::uint32_t(std::min<std::uint64_t>(s.issued, 1u << 20)));
    on_handshakes_ += s.decode;
  }
  ++handshakes_;
  issued_ += s.issued;
  used_ += s.used;
  missed_ += s.missed;
  contended_ += s.missed && s.contended;
  if (handshakes_ < opt_.epoch) return;

  if (state_ == GovernorState::Closed) {  // nothing was issued: only time passes
    start_epoch();
    if (++epochs_in_state_ >= closed_for_) {
      state_ = GovernorState::Probing;
      cap_ = opt_.probe_cap;
      epochs_in_state_ = 0;
      ++probes_;
    }
    return;
  }
  if (issued_ >= opt_.min_issued) {
    judge();
  } else if (state_ == GovernorState::Probing &&
      handshakes_ >= std::uint64_t(opt_.epoch) * opt_.max_probe_epochs) {
    cut();  // a probe that cannot even issue is not worth keeping open
    start_epoch();
  } else if (handshakes_ >= std::uint64_t(opt_.epoch) * kMaxGatherEpochs) {
    start_epoch();  // no evidence, no change
  }
  if (state_ == GovernorState::Open && trial_every_ > 0 &&
      on_handshakes_ >= std::uint64_t(trial_every_) * opt_.epoch)
    begin_trial();
}

void PrefetchGovernor::judge() {
  const double precision = std::min(1.0, double(used_) / double(issued_));
  // Deterministic mode: contention is timing, so assume it (the stricter bar).
  const double busy = opt_.deterministic ? 1.0
                      : missed_          ? double(contended_) / double(missed_)
                                         : 0.0;
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
  // From Open: what the epoch just judged typically issued per handshake, rounded up.
  const std::uint32_t typical = std::uint32_t(std::min<std::uint64_t>(
      (issued_ + handshakes_ - 1) / std::max<std::uint64_t>(handshakes_, 1), 1u << 20));
  const std::uint32_t from = state_ == GovernorState::Open ? typical : cap_;
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
    open();
  } else {
    state_ = GovernorState::Throttled;
    cap_ = next;
  }
}

}  // namespace strata
