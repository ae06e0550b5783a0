// Test hook: make chosen part reads fail with an errno or come back short, so the error paths
// run against a real pack. Guarded by its own mutex because IO threads consult it outside mu_.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>

namespace strata {

// Delay stalls the read (then performs it): the timeout and Ctrl-C paths need a slow disk.
// Gate holds the read until open_gate() (at most delay_ms), so a test can look at a read in
// flight for as long as it needs without depending on timing.
enum class FaultKind : std::uint8_t { Errno, ShortRead, Delay, Gate };

struct Fault {
  FaultKind kind = FaultKind::Errno;
  int err = 5;        // EIO
  int delay_ms = 0;   // for Delay; Gate's longest hold
  int remaining = 1;  // how many reads it still hits; < 0 = forever
};

class FaultInjector {
 public:
  // part < 0 hits every part of the record.
  void add(std::uint32_t key, int part, const Fault& f) {
    std::lock_guard<std::mutex> lk(mu_);
    faults_[{key, part}] = f;
    if (f.kind == FaultKind::Gate) gate_open_ = false;
    armed_.store(true, std::memory_order_relaxed);
  }
  void clear() {
    std::lock_guard<std::mutex> lk(mu_);
    faults_.clear();
  }
  // Returns true and fills `out` when this read should fail.
  bool take(std::uint32_t key, int part, Fault* out) {
    // Every part read asks: without a fault ever added it must not touch the shared mutex.
    if (!armed_.load(std::memory_order_relaxed)) return false;
    std::lock_guard<std::mutex> lk(mu_);
    if (faults_.empty()) return false;
    for (int p : {part, -1}) {
      auto it = faults_.find({key, p});
      if (it == faults_.end() || it->second.remaining == 0) continue;
      *out = it->second;
      if (it->second.remaining > 0) --it->second.remaining;
      return true;
    }
    return false;
  }

  // Gate faults: the read waits here until open_gate() or max_ms.
  void wait_gate(int max_ms) {
    std::unique_lock<std::mutex> lk(mu_);
    gate_cv_.wait_for(lk, std::chrono::milliseconds(max_ms), [this] { return gate_open_; });
  }
  void open_gate() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      gate_open_ = true;
    }
    gate_cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable gate_cv_;
  std::map<std::tuple<std::uint32_t, int>, Fault> faults_;  // guarded by mu_
  bool gate_open_ = true;                                   // guarded by mu_
  std::atomic<bool> armed_{false};  // a fault was ever added: take() must look
};

}  // namespace strata
