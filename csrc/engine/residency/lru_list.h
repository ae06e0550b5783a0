// An intrusive doubly-linked recency list over slot indices: O(1) touch, insert and remove, and
// a walk from the least recently used end. Victim choice walks it and takes the first slot that
// no rule protects, so its cost depends on how many protected slots sit at the cold end (few),
// not on the arena size. Not thread-safe: guarded by ExpertStream::mu_.
#pragma once

#include <cstdint>
#include <vector>

namespace strata {

class LruList {
 public:
  static constexpr std::uint32_t kNone = 0xFFFFFFFFu;

  explicit LruList(std::uint32_t n = 0) : prev_(n, kNone), next_(n, kNone), in_(n, 0) {}

  bool contains(std::uint32_t s) const { return in_[s] != 0; }
  // Most recently used end.
  void touch(std::uint32_t s) {
    if (in_[s]) unlink(s);
    prev_[s] = tail_;
    next_[s] = kNone;
    if (tail_ != kNone) next_[tail_] = s;
    tail_ = s;
    if (head_ == kNone) head_ = s;
    in_[s] = 1;
  }
  void remove(std::uint32_t s) {
    if (in_[s]) unlink(s);
  }
  std::uint32_t coldest() const { return head_; }
  std::uint32_t warmer(std::uint32_t s) const { return next_[s]; }

 private:
  void unlink(std::uint32_t s) {
    if (prev_[s] != kNone) next_[prev_[s]] = next_[s]; else head_ = next_[s];
    if (next_[s] != kNone) prev_[next_[s]] = prev_[s]; else tail_ = prev_[s];
    prev_[s] = next_[s] = kNone;
    in_[s] = 0;
  }

  std::vector<std::uint32_t> prev_, next_;
  std::vector<char> in_;
  std::uint32_t head_ = kNone, tail_ = kNone;
};

}  // namespace strata
