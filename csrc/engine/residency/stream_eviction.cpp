// Protections and victims: which slot a new read may take (I4, I8, I9), and why none when none.
#include "residency/expert_stream.h"

#include <sstream>
#include <string>

namespace strata {

// The union over every client: one Window's victim never comes out of another's protections.
bool ExpertStream::is_protected(std::uint32_t key, bool speculative) const {
  const std::int64_t layer = key / layout().n_experts;
  const std::uint32_t expert = key % layout().n_experts;
  for (const auto& [id, p] : clients_) {
    if (p.executing < 0 && p.next < 0) continue;
    if (layer == p.executing && p.executing_keep[expert]) return true;  // I4
    if (layer == p.next) return true;                                   // I4: next router
    // I9: speculation never evicts the current or the next layer.
    if (speculative && p.executing >= 0 && (layer == p.executing || layer == p.executing + 1))
      return true;
  }
  return false;
}

bool ExpertStream::evictable(std::uint32_t s, bool speculative) const {
  const Slot& sl = slots_[s];
  SlotState st = sl.load();
  if (st != SlotState::Complete && st != SlotState::Failed) return false;
  if (sl.in_flight() || sl.pins) return false;  // I4: reads in flight, plan-resident (I8)
  return !is_protected(sl.key, speculative);
}

std::int32_t ExpertStream::pick_victim(bool speculative) const {
  if (opt_.eviction == EvictionPolicy::DecayedLfu) return pick_coldest_heat(speculative);
  for (std::uint32_t s = lru_.coldest(); s != LruList::kNone; s = lru_.warmer(s))
    if (evictable(s, speculative)) return std::int32_t(s);
  return -1;
}

// The unguarded evictable slot of least heat, else (every candidate guarded) the least recently
// touched one.
std::int32_t ExpertStream::pick_coldest_heat(bool speculative) const {
  heat_order_.settle(heat_, [this](std::uint32_t s) { return slots_[s].key; });
  std::uint32_t s = heat_order_.first([&](std::uint32_t c) { return evictable(c, speculative); });
  return s == LruList::kNone ? -1 : std::int32_t(s);
}

std::int32_t ExpertStream::pick_queued_speculative() const {
  for (std::uint32_t s = lru_.coldest(); s != LruList::kNone; s = lru_.warmer(s)) {
    const Slot& sl = slots_[s];
    if (sl.load() != SlotState::Queued || sl.cls == ReadClass::Urgent) continue;
    if (is_protected(sl.key, false)) continue;
    return std::int32_t(s);
  }
  return -1;
}

// A slot for a new read: free, then finished limbo, then the LRU victim, then (urgent only) a
// queued speculative read cancelled so urgent work never waits behind speculation.
std::int32_t ExpertStream::take_slot(bool speculative) {
  if (free_.empty()) {
    for (std::uint32_t s : limbo_) {
      const Slot& sl = slots_[s];
      if (sl.limbo_releasable()) {
        recycle(s);
        stats_.limbo_released.fetch_add(1, std::memory_order_relaxed);
        break;
      }
    }
  }
  if (free_.empty()) {
    std::int32_t v = pick_victim(speculative);
    if (v >= 0) {
      recycle(std::uint32_t(v));
      stats_.evicted.fetch_add(1, std::memory_order_relaxed);
    } else if (!speculative) {
      std::int32_t q = pick_queued_speculative();
      if (q >= 0) {
        recycle(std::uint32_t(q));
        stats_.cancelled.fetch_add(1, std::memory_order_relaxed);
      }
    }
  }
  if (free_.empty()) return -1;
  std::uint32_t s = free_.back();
  free_.pop_back();
  return std::int32_t(s);
}

std::string ExpertStream::describe_full(ClientId who) const {
  std::ostringstream m;
  std::uint32_t counts[6] = {};
  for (const auto& sl : slots_) ++counts[int(sl.load())];
  m << "no arena slot available for an urgent read: " << slots_.size() << " slots, "
    << counts[int(SlotState::Complete)] << " complete but protected ";
  bool others = false;
  for (const auto& [id, p] : clients_) {
    if (!p.holds_any()) continue;
    m << "[" << (id == who ? "by this caller" : "by another window (client " + std::to_string(std::uint32_t(id)) + ")")
      << ": executing layer " << p.executing << ", next-router layer " << p.next << ", "
      << p.pinned.size() << " plan-pinned" << (p.waiting_for_space ? ", itself waiting" : "")
      << "] ";
    others = others || id != who;
  }
  m << counts[int(SlotState::Queued)] + counts[int(SlotState::Reading)] << " loading, "
    << counts[int(SlotState::Limbo)] << " in limbo; ";
  if (others)
    m << "the windows sharing this stream protect more experts together than the arena holds: "
      << "a larger arena, fewer windows or fewer experts per call is needed";
  else
    m << "a larger arena or fewer experts per call is needed";
  m << " (minimum " << min_slots(layout()) << " slots per top-k call per window)";
  return m.str();
}

std::int32_t ExpertStream::victim(bool speculative) const {
  std::lock_guard<std::mutex> lk(mu_);
  return pick_victim(speculative);
}

std::int32_t ExpertStream::evict_one() {
  std::lock_guard<std::mutex> lk(mu_);
  require_open();
  std::int32_t v = pick_victim(false);
  if (v >= 0) {
    recycle(std::uint32_t(v));
    stats_.evicted.fetch_add(1, std::memory_order_relaxed);
  }
  return v;
}

}  // namespace strata
