// Recorder: what a Window learns and counts as it runs (docs/architecture.md section 2): the
// per-layer figures, the routed choices (record_routes), the expert popularity profile, the
// prediction precision, and the residency the last moce route read.
//
// Threads. The Window's driving call (TurnGate's busy holder) writes everything; any thread reads
// the figures. Lock: mu_ guards the stats, the routes, the route residency, and the profile's
// writes and other threads' reads (the driving call reads the profile without it: set_profile
// is admitted as a call, so no write races that read). The predictions noted for precision and
// the token counters are the driving call's alone.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <vector>

#include "common/timing.h"
#include "exec/backend.h"

namespace strata {

struct LayerStats {
  std::uint64_t calls = 0, tokens = 0, hits = 0, misses = 0, bytes_read = 0;
  std::uint64_t stall_ns = 0;      // host blocked on urgent reads
  std::uint64_t handshake_ns = 0;  // host time in at_layer + after_layer, IO waits excluded
  // The same, as CPU time of the host thread: what the work costs, without the time the
  // scheduler gives the IO and device threads (which dominates wall time on a 2-core machine).
  std::uint64_t handshake_cpu_ns = 0;
  std::uint64_t waves = 0;
  // Prediction at distance 1, as sums over calls: |predicted & actual|, |predicted|, |actual|.
  std::uint64_t pred_correct = 0, pred_predicted = 0, pred_actual = 0;
  // moce: true router probability mass the selection moved off the true top-k (summed over
  // tokens) and how many true top-k choices it replaced.
  double moce_moved = 0;
  std::uint64_t moce_changed = 0;
  std::uint64_t settle_ns = 0;  // host waiting for speculative reads (deterministic moce path)

  LayerStats& operator+=(const LayerStats& o);
};

// Times a host-work section twice: wall clock and the host thread's CPU time.
struct HostTimer {
  Clock::time_point wall = Clock::now();
  std::uint64_t cpu = thread_cpu_ns();
};

class Recorder {
 public:
  Recorder(const PackLayout& layout, bool record_routes);

  // ---- any thread ----
  std::vector<LayerStats> layer_stats() const;
  void reset_stats();
  std::vector<std::int32_t> take_routes();
  std::vector<std::uint32_t> profile() const;
  // EngineError(Config) unless counts has n_layers * n_experts entries.
  void check_profile(const std::vector<std::uint32_t>& counts) const;
  // Size checked; admitted as a driving call (the driving call reads the profile unlocked).
  void set_profile(const std::vector<std::uint32_t>& counts);
  std::vector<std::uint8_t> route_resident() const;
  std::int64_t route_layer() const;

  // ---- the driving call's ----
  template <class F>
  void add(std::uint32_t layer, F&& f) {
    std::lock_guard<std::mutex> lk(mu_);
    f(stats_[layer]);
  }
  // The section `t` timed ends now: its wall and CPU time go to the layer's handshake figures,
  // with the figures it gathered (`more`), under one lock hold.
  void add_host_time(std::uint32_t layer, const HostTimer& t, const LayerStats& more = {});
  // A pass over the model (a layer-0 call of `rows` tokens) begins.
  void begin_pass(std::uint32_t rows);
  // The chunk's routing ids[0, rows * top_k) at `layer`, rows from `row0` of the pass: the
  // profile learns it, and record_routes keeps it.
  void learn(std::uint32_t layer, std::uint32_t row0, const std::int32_t* ids, std::uint32_t rows);
  // Router layer+1's picks for `chunk` of this call, for precision when it reaches layer+1.
  void note_predicted(std::uint32_t next_layer, std::uint32_t chunk,
                      const std::vector<std::int32_t>& predicted);
  // The chunk's actual experts at `layer` against what was noted for it, into `into`'s
  // precision figures (added with the host point's others).
  void score_predicted(std::uint32_t layer, std::uint32_t chunk,
                       const std::vector<std::int32_t>& chosen, LayerStats& into);
  // What the last moce route of `rows` rows at `layer` moved, and the residency it read.
  void note_moce(std::uint32_t layer, std::uint32_t rows, const DeviceBuffers& b);
  // Layer `layer`'s counts (the driving call's read, no lock).
  const std::uint32_t* profile_row(std::uint32_t layer) const {
    return profile_.data() + std::size_t(layer) * n_experts_;
  }

 private:
  const std::uint32_t n_layers_, n_experts_, top_k_;
  const bool record_routes_;

  mutable std::mutex mu_;
  std::vector<LayerStats> stats_;             // mu_
  std::vector<std::int32_t> routes_;          // mu_: (token, layer, expert) while record_routes
  std::vector<std::uint32_t> profile_;        // mu_ for writes and other threads' reads
  std::vector<std::uint8_t> route_resident_;  // mu_
  std::int64_t route_layer_ = -1;             // mu_

  // The driving call's.
  std::int64_t tokens_seen_ = 0;       // tokens whose layer-0 call has started
  std::int64_t pass_first_token_ = 0;  // first token of the pass now running
  // predicted_[layer][chunk]: experts router `layer` chose on layer-1's input, for
  // precision/recall when that chunk reaches `layer`.
  std::vector<std::vector<std::vector<std::int32_t>>> predicted_;
  std::vector<char> actual_;  // [n_experts] score_predicted's marks, kept zero
};

}  // namespace strata
