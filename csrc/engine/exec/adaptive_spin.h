// AdaptiveSpin: whether the host should spin before it blocks on a handshake event, learned from
// how soon the device has been answering.
//
// A spin pays only when the answer arrives within it: then the host skips a thread wake-up
// (tens of microseconds). When the answer comes later, the spin is a core taken from whoever
// else wants it, and on a small machine that is the device's own threads: the CPU backend's
// device thread and pool, MLX's, a server's event loop. A decode step of one row answers within
// a short spin; the same model's step of eight rows takes several times longer, and its spins
// only slowed it (serving's load test on 2 cores: benchmarks/serve_load.py measures it). So each
// wait site keeps a running estimate of its answer time and spins only while that estimate is
// within the budget; a blocked wait still measures the answer time, so the spin comes back when
// answers get short.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

namespace strata {

// ClockT: the time the spin measures answers by (steady_clock; the tests give a clock they move
// themselves, so that no scheduling delay of theirs can decide what they check).
template <class ClockT = std::chrono::steady_clock>
class BasicAdaptiveSpin {
 public:
  using Clock = ClockT;

  explicit BasicAdaptiveSpin(std::chrono::microseconds budget)
      : budget_ns_(std::chrono::duration_cast<std::chrono::nanoseconds>(budget).count()) {}

  // Waits for `ready()`: spins first when that is worth it, else calls `block()` (which returns
  // false on a timeout, passed through). One wait in kProbe spins regardless, so that a site
  // which stopped spinning learns when its answers get short again: only spun waits are
  // measured, since a blocked one also counts the wake-up the spin exists to avoid.
  template <class Ready, class Block>
  bool wait(Ready&& ready, Block&& block) {
    const auto start = Clock::now();
    const bool probe = probes_.fetch_add(1, std::memory_order_relaxed) % kProbe == kProbe - 1;
    const bool spinning = budget_ns_ > 0 && (worth_spinning() || probe);
    if (spinning) {
      const auto until = start + std::chrono::nanoseconds(budget_ns_);
      while (Clock::now() < until) {
        if (ready()) {
          observe(Clock::now() - start);
          return true;
        }
      }
    }
    const bool answered = block();
    if (spinning) observe(Clock::now() - start);
    return answered;
  }

  bool worth_spinning() const {
    return budget_ns_ > 0 && estimate_ns_.load(std::memory_order_relaxed) <= budget_ns_;
  }

  // How long a spun wait's answer took.
  void observe(std::chrono::nanoseconds answered_after) {
    const std::int64_t x = answered_after.count();
    const std::int64_t e = estimate_ns_.load(std::memory_order_relaxed);
    // An exponential average over about the last kWeight spun waits: one long layer does not
    // stop the spin, a run of them does.
    estimate_ns_.store(e + (x - e) / kWeight, std::memory_order_relaxed);
  }

  std::int64_t estimate_ns() const { return estimate_ns_.load(std::memory_order_relaxed); }

 private:
  static constexpr std::int64_t kWeight = 4;
  static constexpr std::uint32_t kProbe = 16;
  const std::int64_t budget_ns_;
  // Written and read by the thread holding the Window's call (its caller lock); atomic so that
  // a stats read from another thread is not a race.
  std::atomic<std::int64_t> estimate_ns_{0};
  std::atomic<std::uint32_t> probes_{0};
};

using AdaptiveSpin = BasicAdaptiveSpin<>;

}  // namespace strata
