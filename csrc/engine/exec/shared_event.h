// SharedEvent: the semantics of MTLSharedEvent on the host. A monotonic 64-bit value; anyone may
// signal a larger value, anyone may wait until the value reaches a target. The CPU backend's
// device thread and the host both use it, exactly as a GPU and its host would.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>

namespace strata {

class SharedEvent {
 public:
  void signal(std::uint64_t v) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (v > value_) value_ = v;  // monotonic, as MTLSharedEvent is used here
    }
    cv_.notify_all();
  }
  std::uint64_t value() const {
    std::lock_guard<std::mutex> lk(mu_);
    return value_;
  }
  void wait(std::uint64_t v) {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return value_ >= v; });
  }
  // Bounded, interruptible wait: polls `interrupt` (which may throw) every `poll`; returns false
  // when `timeout` passes first.
  bool wait_for(std::uint64_t v, std::chrono::duration<double> timeout,
                const std::function<void()>& interrupt,
                std::chrono::milliseconds poll = std::chrono::milliseconds(50)) {
    auto deadline = std::chrono::steady_clock::now() + timeout;
    std::unique_lock<std::mutex> lk(mu_);
    while (value_ < v) {
      if (std::chrono::steady_clock::now() >= deadline) return false;
      cv_.wait_for(lk, poll);
      if (value_ >= v) break;
      if (interrupt) {
        lk.unlock();
        interrupt();
        lk.lock();
      }
    }
    return true;
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::uint64_t value_ = 0;  // guarded by mu_
};

}  // namespace strata
