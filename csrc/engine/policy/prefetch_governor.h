// PrefetchGovernor: backs speculative reads off when they do not pay (docs/architecture.md section 6).
//
// Speculative reads yield to urgent ones in the IO queue (I9), but once a speculative part is
// being read it shares the SSD with the urgent parts behind it; public measurements show
// next-layer prefetch costing 13-38% wall clock on an already busy SSD. The Window feeds the
// governor one Sample per handshake and asks it, before queueing speculation, how many new
// speculative reads it may start (cap()).
//
// Two tests, because precision alone cannot see the busy-SSD loss: a prediction that is 80%
// right still adds 20% more reads, and when the SSD is the bottleneck those cost wall clock
// that overlap cannot win back.
//
// 1. Precision, judged once per epoch (`epoch` handshakes holding at least `min_issued` speculative
// reads, so a judgement rests on evidence):
//   precision p = speculative reads an urgent request later used / speculative reads started;
//   busy        = among handshakes whose urgent reads missed, the fraction during whose wait
//                 speculative parts were in flight is >= busy_fraction;
//   pays        = p >= (busy ? busy_precision : idle_precision).
// On a busy SSD a wasted read delays urgent work by about one record read and a used one saves
// at most about one (it is the same read, moved earlier), so break-even is p = 1/2. On an idle
// SSD a wasted read costs only a slot and idle bandwidth; the lower bar still stops a
// prediction that is mostly noise. (In decode the next layer's reads are queued at the very
// handshake whose urgent reads are then waited for, so there `busy` is nearly always true.)
//
// 2. A trial: after trial_every epochs' worth of decode handshakes Open, the governor runs
// 2 * trial_epochs epochs' worth of decode handshakes alternately without and with
// speculation, in the order off, on, on, off (ABBA: the load on a shared SSD drifts, and a
// drift linear over the trial then weighs both arms alike), and compares the arms' mean wall
// time of a decode layer call. Decode time only: a prompt chunk's time is of another scale
// (prompt handshakes during a trial keep the arm's cap and add no time). But every handshake
// counts toward an arm's length: an arm ends after `epoch` decode handshakes or
// `trial_arm_max` epochs' worth of handshakes of any kind, whichever comes first, so a
// prompt-only stretch cannot hold speculation in an off arm forever. A trial in which an arm
// kind saw no decode handshake at all has nothing to compare: it is abandoned (back to Open, no
// verdict, the interval unchanged). The whole call, not only the urgent stall:
// wasted reads also cost through later layers' stalls and, on a small machine, through the
// CPU the IO path takes from the kernels. If a call with prefetch takes more than
// (1 + trial_margin) times one without, speculation costs more than it hides: Closed. A trial
// that keeps prefetch doubles the interval to the next (up to trial_every_max), so when
// prefetch pays the trials cost little; one that closes it doubles how long Closed lasts
// before the next probe (up to closed_epochs_max), so on a persistently busy SSD speculation
// stays off most of the time.
//
// States (the cap in brackets):
//   Open [unlimited] --not paying--> Throttled [typical/2] --not paying--> ... halving ...
//   Throttled [1] --not paying--> Closed [0] --closed_epochs epochs--> Probing [probe_cap]
//   Probing --pays--> Throttled [2 * probe_cap] --pays--> ... doubling ... --> Open
//   Probing --not paying (or no evidence within max_probe_epochs)--> Closed
//   Open --trial_every epochs--> Trial [0 / unlimited, by arm] --not slower with--> Open
//                                Trial --slower with prefetch--> Closed
// `typical` is the judged epoch's new speculative reads per handshake, rounded up: the cap
// starts from what the unthrottled policy actually issued (a few in decode, many in a prompt).
// `peak`, the most one handshake started while Open, is where raising reopens fully.
//
// Deterministic mode (`deterministic`, set by the Window when it settles IO for moce with
// PUBLISH_PREFETCH=0): the cap must then be a function of the call history alone, because it
// decides which experts are read and so what moce routing sees. Issued, used and missed are
// (residency is settled at every host point); wall time and `contended` are not. So no trials
// run, and every judgement uses the busy bar (busy_precision), as if each miss had waited
// behind speculation, which in decode it nearly always does.
//
// 3. Per layer: the Window's handshake at layer l starts the speculative reads for layer l+1
// (and l+2 under two-layer lookahead, and the profile's), and the urgent requests of the
// handshake at l+1 use them. So a sample that names its layer gives evidence per target layer:
// its `issued` counts toward layer l+1, its `used` toward layer l. Each target layer is judged
// at its own handshake once at least layer_min_issued reads were started for it since its last
// judgement: its measured precision (used / issued) against layer_precision. Below it, the
// layer's own cap halves (from what it typically started per handshake), and since the Window
// queues predictions best first (a router's top-k order), a smaller cap reads only the likelier
// ones; at a cap of 1 still below, the layer is gated (cap 0) for layer_gated_epochs epochs (of
// the Window's epoch: tokens in decode), then measured afresh on its best prediction alone, a
// gate that fails again at once lasting twice as long (up to closed_epochs_max). At or above
// the bar a capped layer's cap doubles, back to unlimited once it reaches the most the layer
// ever started in one handshake. cap_for(l) is the lesser of the global cap and layer l+1's.
// So unused speculative reads stay near 1 - layer_precision of those started where each
// layer's precision persists, while the layers whose predictions are right keep their reads.
// A sample without a layer (kNoLayer) feeds the global rule only.
//
// 4. Per prediction rank: within a layer the predictions are not alike. A decode token's
// prediction is router l+1's top-k on layer l's input, best first, and its first ranks are
// right far more often than its last (the last ones are where a small change of the input
// swaps experts across the top-k boundary). So each (target layer, rank) keeps its own
// precision: of the predictions at that rank that were not in the arena when they were
// predicted (those a read would start for), the share the target layer's urgent request then
// chose. It is measured whether or not the read was started (observe_rank), so a rank held
// back keeps gathering evidence and comes back as soon as it predicts well: no probes, and no
// read spent to find out. A rank whose decayed precision (rank_decay per observation) falls
// below rank_precision, once it rests on rank_min_trials observations, is not read
// (rank_gated); the ranks above it still are. Where the per-layer gate (3.) can only halve a
// layer's reads, dropping its right predictions with its wrong ones (each a stall more), this
// drops the wrong-most ranks alone.
//
// Not thread-safe: the Window's host thread owns it (every Window method runs on one thread).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "residency/slot.h"

namespace strata {

enum class GovernorState : std::uint8_t { Open, Throttled, Closed, Probing, Trial };

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
  std::uint32_t closed_epochs_max = 64;  // ...doubling after each trial prefetch fails
  std::uint32_t probe_cap = 2;       // new speculative reads per handshake while probing
  std::uint32_t max_probe_epochs = 4;  // a probe that gathers no evidence gives up
  // Open epochs before the first trial (0 = no trials): with epoch = one token, 8 tokens, so
  // the first trial costs at most 2 tokens in 10 without prefetch, and each passed trial halves
  // that share.
  std::uint32_t trial_every = 8;
  std::uint32_t trial_every_max = 256; // ...doubling after each trial prefetch passes
  std::uint32_t trial_epochs = 2;      // epochs per arm kind: 2 off + 2 on per trial
  double trial_margin = 0.1;           // noise between epochs the trial tolerates
  std::uint32_t trial_arm_max = 4;     // epochs' worth of handshakes of any kind an arm may last
  // Timing-free: no trials, contention assumed (see "Deterministic mode" above).
  bool deterministic = false;
  // Per-layer gate (3. above): the least precision a layer's speculation must show (0: no
  // gate). Off by default: halving a layer's reads drops its right predictions with its wrong
  // ones, each a stall more, and the per-rank gate (4.) takes the wrong ones alone for fewer
  // stalls at any share of unused reads. A bar for it sits above the quarter of unused reads
  // to aim for: its judgements are noisy, and the first reads of each layer and the probes
  // after a gate are started before it can tell.
  double layer_precision = 0;
  std::uint32_t layer_min_issued = 16;  // reads a layer's judgement rests on
  std::uint32_t layer_gated_epochs = 8;  // epochs a gated layer waits before it is measured again
  // Per-rank gate (4. above): the least precision a prediction rank must show to be read (0:
  // no gate), the observations its judgement needs, and how fast old ones fade (0.97: an
  // observation weighs half once 23 more of its rank's have come). The bar is the busy SSD's break-even of
  // 1. above: below it a read wastes more urgent bandwidth than it saves stalls; a higher bar
  // cuts more unused reads at the price of more urgent misses.
  double rank_precision = 0.5;
  std::uint32_t rank_min_trials = 8;
  double rank_decay = 0.97;
};

// One handshake as the governor sees it. `issued` and `used` are deltas of the stream's
// counters (spec_requests, spec_hits) since the previous sample; `used` may count reads issued
// in an earlier epoch, so precision is clamped to 1.
struct GovernorSample {
  std::uint64_t issued = 0;
  std::uint64_t used = 0;
  bool missed = false;     // the handshake's urgent reads had to come from the SSD
  bool contended = false;  // ...and speculative parts were in flight while the host waited
  std::uint64_t wall_ns = 0;  // wall time of the layer call
  bool decode = true;         // a decode handshake (trials compare only these)
  // The handshake's layer: `issued` counts toward layer + 1's precision, `used` toward its own.
  std::uint32_t layer = kNoLayer;
  static constexpr std::uint32_t kNoLayer = 0xFFFFFFFFu;
};

class PrefetchGovernor {
 public:
  static constexpr std::uint32_t kUnlimited = kUnlimitedReads;

  explicit PrefetchGovernor(const GovernorOptions& options = {});

  // New speculative reads the next handshake may start (kUnlimited while Open).
  std::uint32_t cap() const { return cap_; }
  // The same at the handshake of `layer`: 0 while layer + 1 is gated for its precision.
  std::uint32_t cap_for(std::uint32_t layer) const {
    return layer + 1 < layers_.size() ? std::min(cap_, layers_[layer + 1].cap) : cap_;
  }
  // Layer `layer`'s own cap on the reads started for it (kUnlimited: none).
  std::uint32_t layer_cap(std::uint32_t layer) const {
    return layer < layers_.size() ? layers_[layer].cap : kUnlimited;
  }
  // Layer `layer`'s precision at its last judgement, -1 before one.
  double layer_precision(std::uint32_t layer) const;
  bool layer_gated(std::uint32_t layer) const {
    return layer < layers_.size() && layers_[layer].gated_for > 0;
  }
  std::uint64_t layer_gates() const { return layer_gates_; }  // times a layer was gated
  std::uint32_t layers_seen() const { return std::uint32_t(layers_.size()); }
  GovernorState state() const { return state_; }
  void observe(const GovernorSample& s);
  // Speculative reads started for `layer` outside a handshake (a turn's start-layer reads):
  // evidence for that layer's gate, judged at its handshake like the rest.
  void observe_start(std::uint32_t layer, std::uint64_t issued);
  // A prediction for `layer` at `rank` (0: the best) that was absent from the arena when made:
  // whether `layer`'s urgent request then chose it (4. above).
  void observe_rank(std::uint32_t layer, std::uint32_t rank, bool chosen);
  // Whether an absent prediction for `layer` at `rank` is left unread for its precision.
  bool rank_gated(std::uint32_t layer, std::uint32_t rank) const;
  // Its decayed precision, -1 before any observation.
  double rank_precision(std::uint32_t layer, std::uint32_t rank) const;

  // Reporting.
  std::uint32_t peak() const { return peak_; }
  std::uint64_t epochs() const { return epochs_; }  // judgements made
  std::uint64_t cuts() const { return cuts_; }
  std::uint64_t raises() const { return raises_; }
  std::uint64_t probes() const { return probes_; }
  double last_precision() const { return last_precision_; }  // -1 before the first judgement
  double last_busy() const { return last_busy_; }            // -1 before the first judgement
  std::uint64_t trials() const { return trials_; }  // trials that reached a verdict
  std::uint64_t abandoned_trials() const { return abandoned_trials_; }  // no decode in an arm
  // Mean wall time (ns) of a decode layer call with and without speculation, last trial.
  double last_wall_on() const { return last_wall_on_; }    // -1 before the first trial
  double last_wall_off() const { return last_wall_off_; }  // -1 before the first trial
  const GovernorOptions& options() const { return opt_; }

 private:
  void judge();
  void cut();
  void raise();
  void start_epoch();
  void open();  // (re)enters Open: the time baseline starts afresh
  void begin_trial();
  void trial_sample(const GovernorSample& s);
  void end_trial();
  void observe_layer(const GovernorSample& s);

  GovernorOptions opt_;
  GovernorState state_ = GovernorState::Open;
  std::uint32_t cap_ = kUnlimited;
  std::uint32_t peak_ = 1;  // most new reads one handshake started while Open

  // The epoch being gathered.
  std::uint32_t handshakes_ = 0;
  std::uint32_t epochs_in_state_ = 0;  // Closed: epochs waited; Probing: epochs probed
  std::uint64_t issued_ = 0, used_ = 0, missed_ = 0, contended_ = 0;

  // Trials. on_handshakes_: decode handshakes Open since open(); arm_: the arm running;
  // arm_decode_ / arm_handshakes_: its decode handshakes / handshakes of any kind so far;
  // arm_wall_[off=0 / on=1]: summed wall ns and decode handshakes of each kind of arm.
  std::uint32_t trial_every_;
  std::uint32_t arm_ = 0, arm_decode_ = 0, arm_handshakes_ = 0;
  std::pair<std::uint64_t, std::uint64_t> arm_wall_[2] = {};
  std::uint32_t closed_for_;  // epochs Closed lasts now
  std::uint64_t on_handshakes_ = 0;

  std::uint64_t epochs_ = 0, cuts_ = 0, raises_ = 0, probes_ = 0, trials_ = 0;
  std::uint64_t abandoned_trials_ = 0;

  // Per target layer (3. above): speculative reads started for it and used by it since its
  // last judgement, over `handshakes`; its cap; gated_for: its handshakes left gated (0: not
  // gated); gate_epochs: how long its last gate lasted; peak: the most one handshake started.
  struct LayerEvidence {
    double issued = 0, used = 0;
    std::uint32_t handshakes = 0;
    std::uint32_t cap = kUnlimitedReads;
    std::uint32_t peak = 1;
    std::uint32_t gated_for = 0;
    std::uint32_t gate_epochs = 0;
    bool regated = false;  // not judged since a gate ended
    double last = -1;      // precision at the last judgement
  };
  std::vector<LayerEvidence> layers_;
  // Per target layer, per rank (4. above): decayed observations and of them the chosen ones.
  struct RankEvidence {
    double trials = 0, chosen = 0;
    std::uint32_t seen = 0;  // observations, undecayed (the judgement's evidence threshold)
  };
  std::vector<std::vector<RankEvidence>> ranks_;
  std::uint64_t layer_gates_ = 0;
  double last_precision_ = -1, last_busy_ = -1, last_wall_on_ = -1, last_wall_off_ = -1;
};

}  // namespace strata
