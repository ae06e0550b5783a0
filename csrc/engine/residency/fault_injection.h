// Test hook: make chosen part reads fail with an errno or come back short, so the error paths
// run against a real pack. Guarded by its own mutex because IO threads consult it outside mu_.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>

namespace strata {

// Delay stalls the read (then performs it): the timeout and Ctrl-C paths need a slow disk.
enum class FaultKind : std::uint8_t { Errno, ShortRead, Delay };

struct Fault {
  FaultKind kind = FaultKind::Errno;
  int err = 5;        // EIO
  int delay_ms = 0;   // for Delay
  int remaining = 1;  // how many reads it still hits; < 0 = forever
};

class FaultInjector {
 public:
  // part < 0 hits every part of the record.
  void add(std::uint32_t key, int part, const Fault& f) {
    std::lock_guard<std::mutex> lk(mu_);
    faults_[{key, part}] = f;
  }
  void clear() {
    std::lock_guard<std::mutex> lk(mu_);
    faults_.clear();
  }
  // Returns true and fills `out` when this read should fail.
  bool take(std::uint32_t key, int part, Fault* out) {
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

 private:
  std::mutex mu_;
  std::map<std::tuple<std::uint32_t, int>, Fault> faults_;  // guarded by mu_
};

}  // namespace strata
