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

  explicit LruList(std::uint32_t n = 0) : node_(n) {}

  bool contains(std::uint32_t s) const { return node_[s].in != 0; }
  // Most recently used end.
  void touch(std::uint32_t s) {
    Node& n = node_[s];
    if (n.in) unlink(s);
    n.prev = tail_;
    n.next = kNone;
    if (tail_ != kNone) node_[tail_].next = s;
    tail_ = s;
    if (head_ == kNone) head_ = s;
    n.in = 1;
  }
  void remove(std::uint32_t s) {
    if (node_[s].in) unlink(s);
  }
  std::uint32_t coldest() const { return head_; }
  std::uint32_t warmer(std::uint32_t s) const { return node_[s].next; }

 private:
  // A slot's links and membership side by side: a touch reads one line per slot it links, not
  // one per array (the lists are cold in the cache at each host point).
  struct Node {
    std::uint32_t prev = kNone, next = kNone, in = 0;
  };

  void unlink(std::uint32_t s) {
    Node& n = node_[s];
    if (n.prev != kNone) node_[n.prev].next = n.next; else head_ = n.next;
    if (n.next != kNone) node_[n.next].prev = n.prev; else tail_ = n.prev;
    n.prev = n.next = kNone;
    n.in = 0;
  }

  std::vector<Node> node_;
  std::uint32_t head_ = kNone, tail_ = kNone;
};

}  // namespace strata
