// Pending part reads, one FIFO per ReadClass so that speculative work always yields to urgent
// work at part granularity. Not thread-safe: guarded by ExpertStream::mu_, but for
// maybe_nonempty(), a hint an IO thread spinning without the lock polls (io_spin_us).
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <vector>

#include "residency/slot.h"

namespace strata {

struct IoJob {
  std::uint32_t slot;
  std::uint32_t gen;  // the slot generation the job was issued for
  std::uint16_t part;
  ReadClass cls;
};

class IoQueue {
 public:
  void push(const IoJob& j) {
    q_[static_cast<int>(j.cls)].push_back(j);
    sync_hint();
  }
  // Whether jobs may be queued, readable without the owner's lock: stored after every change
  // made under it, so a reader that sees it set takes the lock and checks the queue itself.
  bool maybe_nonempty() const { return size_hint_.load(std::memory_order_relaxed) != 0; }
  bool empty() const {
    for (const auto& q : q_)
      if (!q.empty()) return false;
    return true;
  }
  std::size_t size() const {
    std::size_t n = 0;
    for (const auto& q : q_) n += q.size();
    return n;
  }
  // Highest-priority job first.
  IoJob pop() {
    for (auto& q : q_)
      if (!q.empty()) {
        IoJob j = q.front();
        q.pop_front();
        sync_hint();
        return j;
      }
    return IoJob{kNoKey, 0, 0, ReadClass::Urgent};
  }
  // Removes every job of `slot` (cancel, recycle, parking); appends their parts to `parts` when
  // given, so that parking a reading slot can queue exactly those parts again on revive.
  std::size_t drop_slot(std::uint32_t slot, std::vector<std::uint16_t>* parts = nullptr) {
    std::size_t n = 0;
    for (auto& q : q_)
      for (auto it = q.begin(); it != q.end();)
        if (it->slot == slot) {
          if (parts) parts->push_back(it->part);
          it = q.erase(it);
          ++n;
        } else {
          ++it;
        }
    sync_hint();
    return n;
  }
  // Moves a slot's queued jobs to another class (a speculative read that became urgent).
  void promote(std::uint32_t slot, ReadClass to) {
    std::vector<IoJob> moved;
    for (auto& q : q_)
      for (auto it = q.begin(); it != q.end();)
        if (it->slot == slot) {
          moved.push_back(*it);
          it = q.erase(it);
        } else {
          ++it;
        }
    for (auto j : moved) {
      j.cls = to;
      push(j);  // the last push stores the hint; with nothing moved the size did not change
    }
  }
  // In priority order (the order pop() would return them).
  std::vector<IoJob> snapshot() const {
    std::vector<IoJob> out;
    for (const auto& q : q_) out.insert(out.end(), q.begin(), q.end());
    return out;
  }
  // Removes and returns the i-th job in priority order (manual IO test hook).
  IoJob take(std::size_t i) {
    for (auto& q : q_) {
      if (i < q.size()) {
        IoJob j = q[i];
        q.erase(q.begin() + std::ptrdiff_t(i));
        sync_hint();
        return j;
      }
      i -= q.size();
    }
    return IoJob{kNoKey, 0, 0, ReadClass::Urgent};
  }

 private:
  void sync_hint() { size_hint_.store(size(), std::memory_order_relaxed); }

  std::array<std::deque<IoJob>, kReadClasses> q_;
  std::atomic<std::size_t> size_hint_{0};  // size(), stored under the owner's lock
};

}  // namespace strata
