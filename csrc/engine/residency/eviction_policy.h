// Eviction policy: which evictable slot gives way to a new read.
//
// ExpertStream alone decides what MAY be evicted (I4, I7-I9: executing and next layer, reads in
// flight, plan pins); a policy only ranks what may. Two policies:
//
// - Lru: the least recently touched slot.
// - DecayedLfu (default): the slot whose key has the lowest heat, an exponentially decayed count
//   of routed uses with a time constant of `tau` accesses, kept per key across evictions, so an
//   expert that keeps coming back is remembered after it was evicted once. Keys used (routed or
//   predicted) within the last `guard` accesses are not ranked by heat: a key just read in for
//   the first time has the lowest heat of all and would otherwise be the next victim, before its
//   next token could use it. If every evictable key is guarded, the least recently used goes.
//
// Heat is weighed by what a miss of the key's layer costs. A miss that lookahead read ahead
// of its layer (a "covered" miss) costs IO but no wait; a miss nobody predicted stalls the
// layer. The first MoE layer of each token is never predicted, so with equal heat its keys
// are the expensive ones to lose. Each layer keeps a decayed count of its stalled and covered
// misses; a key ranks by heat + log(w), w = P(stall) + kIoShare, P(stall) = (stalled + 1) /
// (stalled + covered + 2). kIoShare = 1/2 is what a covered read still costs against a stalled
// one: its IO (a read's CPU and bandwidth here are about half its latency); so a layer whose
// misses all stall weighs three times one whose misses are all covered, the same heat ratio
// as about 1.1 tau of recency. Without lookahead every layer's w is the same and the order is
// plain decayed LFU.
//
// Units: the access clock counts routed expert uses. The Stream sets tau and guard in tokens
// (one token = n_layers * top_k uses), not in numbers fitted to one trace: guard = 1 token
// (none when the arena holds fewer slots than one token's uses, see ExpertStream's
// constructor), tau = 16 tokens. Victim choice costs O(log n_slots) amortised plus the protected slots it skips
// (HeatOrder), not a scan of the arena. On the Qwen3-30B-A3B trace the hit rate is flat within 0.002 for tau between
// 16 and 24 tokens; see `strata-stream replay` and docs/design-notes.md.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include "residency/lru_list.h"

namespace strata {

enum class EvictionPolicy : std::uint8_t { Lru, DecayedLfu };

const char* to_string(EvictionPolicy p);
std::optional<EvictionPolicy> parse_eviction_policy(std::string_view name);

// Per-key heat and recency for DecayedLfu. Not thread-safe: guarded by ExpertStream::mu_.
class KeyHeat {
 public:
  KeyHeat() = default;
  KeyHeat(std::uint32_t n_keys, std::uint32_t keys_per_layer, double tau_accesses,
          std::uint64_t guard_accesses)
      : keys_(n_keys),
        per_layer_(keys_per_layer == 0 ? 1 : keys_per_layer),
        misses_((n_keys + per_layer_ - 1) / per_layer_),
        tau_(tau_accesses),
        guard_(guard_accesses) {
    for (LayerMisses& m : misses_) m.log_weight = std::log(0.5 + kIoShare);
  }

  // A routed use. heat = log(sum_i exp(t_i / tau)) over the uses' clock values t_i: comparing
  // two heats compares the decayed counts (every key decays by the same factor), and nothing
  // needs rescaling as the clock runs (t / tau stays far inside double range).
  void on_use(std::uint32_t key) {
    ++clock_;
    const double x = double(clock_) / tau_;
    double& h = keys_[key].heat;
    h = h > x ? h + std::log1p(std::exp(x - h)) : x + std::log1p(std::exp(h - x));
    keys_[key].last = clock_;
  }
  // Predicted for the next layers: protected like a fresh use, but no heat (a guess is not a use).
  void on_predicted(std::uint32_t key) { keys_[key].last = clock_; }

  // A routed use that had to read its key now (the layer waits), or that found it read ahead
  // by lookahead (its first use of a speculative read).
  void on_stalled_miss(std::uint32_t key) { count_miss(key, true); }
  void on_covered_miss(std::uint32_t key) { count_miss(key, false); }

  bool guarded(std::uint32_t key) const {
    const std::uint64_t last = keys_[key].last;
    return last != kNever && clock_ - last < guard_;
  }
  double heat(std::uint32_t key) const { return keys_[key].heat; }
  // What victims are ranked by: heat weighed by the cost of a miss in the key's layer.
  double ranked_heat(std::uint32_t key) const {
    return keys_[key].heat + misses_[key / per_layer_].log_weight;
  }
  double stall_weight(std::uint32_t layer) const { return std::exp(misses_[layer].log_weight); }

  static constexpr double kIoShare = 0.5;

 private:
  static constexpr std::uint64_t kNever = std::numeric_limits<std::uint64_t>::max();
  // Counts decay by half once a layer has seen this many misses since: recent behaviour rules.
  static constexpr double kMissWindow = 4096;
  struct LayerMisses {
    double stalled = 0, covered = 0;
    double log_weight = 0;  // log(P(stall) + kIoShare)
  };
  void count_miss(std::uint32_t key, bool stalled) {
    LayerMisses& m = misses_[key / per_layer_];
    (stalled ? m.stalled : m.covered) += 1;
    if (m.stalled + m.covered > kMissWindow) {
      m.stalled /= 2;
      m.covered /= 2;
    }
    m.log_weight = std::log((m.stalled + 1) / (m.stalled + m.covered + 2) + kIoShare);
  }

  // Per key, side by side (a use or a guard check reads one line, not one per array): its heat
  // (-inf = never used) and the clock of its last use or prediction.
  struct Key {
    double heat = -std::numeric_limits<double>::infinity();
    std::uint64_t last = kNever;
  };
  std::vector<Key> keys_;
  std::uint32_t per_layer_ = 1;       // keys per layer (n_experts)
  std::vector<LayerMisses> misses_;   // per layer
  std::uint64_t clock_ = 0;           // routed uses so far
  double tau_ = 1;
  std::uint64_t guard_ = 0;
};

// The order in which DecayedLfu offers victims: "settled" slots (their key's guard expired) by
// heat, coldest first, then "fresh" slots (guarded) least recently touched first. A key's heat
// only changes when it is used, and a use touches its slot, which makes the slot fresh again: so
// a settled slot's heat is never stale. Fresh slots settle lazily, from the cold end of the touch
// order, when a victim is wanted.
//
// Settled slots live in a binary min-heap in one flat vector, with lazy deletion: a touch only
// bumps the slot's stamp, and entries whose stamp is old are dropped when they surface. A tree
// (std::set) gave the same victims but cost measurably more host CPU per decode handshake than
// LRU (benchmarks/handshake.py measures it): its nodes are cold in the cache by the next
// handshake, after the device threads have streamed expert weights through it. Not
// thread-safe: guarded by ExpertStream::mu_.
class HeatOrder {
 public:
  HeatOrder() = default;
  explicit HeatOrder(std::uint32_t n_slots) : fresh_(n_slots), stamp_(n_slots, 0) {
    heap_.reserve(2 * std::size_t(n_slots));
  }

  void touched(std::uint32_t s) {
    ++stamp_[s];  // any heap entry of s is stale now
    fresh_.touch(s);
  }
  void removed(std::uint32_t s) {
    ++stamp_[s];
    fresh_.remove(s);
  }
  // Moves fresh slots whose key is no longer guarded into the heat order. key_of(slot) -> key.
  template <class KeyOf>
  void settle(const KeyHeat& heat, KeyOf key_of) {
    for (std::uint32_t s = fresh_.coldest(); s != LruList::kNone; s = fresh_.coldest()) {
      const std::uint32_t key = key_of(s);
      if (heat.guarded(key)) break;  // the touch order is the guard order: the rest are fresher
      fresh_.remove(s);
      push(Entry{heat.ranked_heat(key), s, ++stamp_[s]});
    }
    // Stale entries are dropped as they surface; if touches outpace victims, compact.
    if (heap_.size() > 2 * stamp_.size()) {
      std::erase_if(heap_, [&](const Entry& e) { return stale(e); });
      std::make_heap(heap_.begin(), heap_.end(), Later{});
    }
  }
  // Calls pick(slot) on settled slots by rising heat (ties: lower slot), then on fresh ones from
  // least recently touched, until it returns true; returns that slot or LruList::kNone.
  template <class Pick>
  std::uint32_t first(Pick pick) {
    std::uint32_t found = LruList::kNone;
    while (!heap_.empty()) {
      const Entry e = pop();
      if (stale(e)) continue;
      skipped_.push_back(e);  // still settled: back into the heap below, picked or not
      if (pick(e.slot)) {
        found = e.slot;
        break;
      }
    }
    for (const Entry& e : skipped_) push(e);
    skipped_.clear();
    if (found != LruList::kNone) return found;
    for (std::uint32_t s = fresh_.coldest(); s != LruList::kNone; s = fresh_.warmer(s))
      if (pick(s)) return s;
    return LruList::kNone;
  }

 private:
  struct Entry {
    double heat;
    std::uint32_t slot, stamp;
  };
  struct Later {  // heap order: the root is the least (heat, slot)
    bool operator()(const Entry& a, const Entry& b) const {
      return a.heat > b.heat || (a.heat == b.heat && a.slot > b.slot);
    }
  };
  bool stale(const Entry& e) const { return e.stamp != stamp_[e.slot]; }
  void push(const Entry& e) {
    heap_.push_back(e);
    std::push_heap(heap_.begin(), heap_.end(), Later{});
  }
  Entry pop() {
    std::pop_heap(heap_.begin(), heap_.end(), Later{});
    Entry e = heap_.back();
    heap_.pop_back();
    return e;
  }

  LruList fresh_;                      // guarded slots, by last touch
  std::vector<Entry> heap_;            // settled slots (and stale entries), min-heap by Later
  std::vector<std::uint32_t> stamp_;   // per slot: bumped on every touch, removal or settle
  std::vector<Entry> skipped_;         // scratch of first(): popped entries to push back
};

}  // namespace strata
