// The slot state machine's named transitions (slot.h), all under mu_, and the lifecycle primitives built on them.
#include "residency/expert_stream.h"

#include <algorithm>
#include <stdexcept>

#include "common/check.h"
#include "residency/smap.h"

namespace strata {

void ExpertStream::assign(std::uint32_t s, std::uint32_t key, ReadClass cls) {
  Slot& sl = slots_[s];
  STRATA_ASSERT(sl.load() == SlotState::Free && sl.key == kNoKey, "assign takes a free slot");
  STRATA_ASSERT(where_[key] < 0, "a key lives in at most one slot");
  sl.key = key;
  sl.cls = cls;
  sl.parts_total = std::uint16_t(n_parts_);
  sl.parts_started = sl.parts_done = 0;
  sl.failed_part = sl.published = false;
  sl.used = cls == ReadClass::Urgent;
  sl.err = 0;
  sl.err_offset = 0;
  sl.cause.clear();
  sl.unread.clear();
  sl.miss = Slot::MissTimes{};
  if (cls == ReadClass::Urgent) sl.miss.queued = Clock::now();
  touch(s);
  sl.state.store(SlotState::Queued, std::memory_order_release);
  where_[key] = std::int32_t(s);
  enqueue_parts(s);
}

void ExpertStream::enqueue_parts(std::uint32_t s) {
  Slot& sl = slots_[s];
  for (std::uint16_t p = sl.parts_started; p < sl.parts_total; ++p)
    queue_.push(IoJob{s, sl.gen, p, sl.cls});
  wake_io_.store(true, std::memory_order_relaxed);  // woken once, after the caller drops mu_
}

void ExpertStream::wake_io() {
  // One wake-up from the host; each IO thread that takes a job wakes the next while work
  // remains (io_loop), so the cost of waking the pool lands on the IO threads, not the handshake.
  if (wake_io_.exchange(false)) io_cv_.notify_one();
}

void ExpertStream::touch(std::uint32_t s) {
  slots_[s].last_use = ++clock_;
  lru_.touch(s);
  heat_order_.touched(s);
}

void ExpertStream::publish_slot(std::uint32_t s) {
  Slot& sl = slots_[s];
  STRATA_ASSERT(sl.load() == SlotState::Complete, "I1: only complete slots are published");
  STRATA_ASSERT(where_[sl.key] == std::int32_t(s), "I1: published slot holds its key");
  if (sl.published) return;
  smap_store(smap_.get(), sl.key, s);
  sl.published = true;
}

void ExpertStream::unpublish(std::uint32_t s) {
  Slot& sl = slots_[s];
  if (!sl.published) return;
  smap_store(smap_.get(), sl.key, kAbsent);
  sl.published = false;
}

// I5: the maps forget the key before the slot's bytes can be reused.
void ExpertStream::recycle(std::uint32_t s) {
  Slot& sl = slots_[s];
  STRATA_ASSERT(!sl.in_flight(), "I7: never recycle a slot with a read in flight");
  STRATA_ASSERT(sl.pins == 0, "I8: never recycle a plan-resident slot");
  if (sl.load() == SlotState::Limbo) limbo_.erase(std::find(limbo_.begin(), limbo_.end(), s));
  if (sl.load() == SlotState::Queued || sl.load() == SlotState::Limbo) queue_.drop_slot(s);
  lru_.remove(s);
  heat_order_.removed(s);
  if (sl.key != kNoKey) {
    unpublish(s);
    where_[sl.key] = -1;
  }
  sl.key = kNoKey;
  ++sl.gen;
  sl.unread.clear();
  sl.parts_total = sl.parts_started = sl.parts_done = 0;
  sl.failed_part = sl.published = sl.used = false;
  sl.state.store(SlotState::Free, std::memory_order_release);
  free_.push_back(s);
}

// I7: an unchosen speculative slot leaves the device's view and waits for its reads to finish.
void ExpertStream::park(std::uint32_t s) {
  Slot& sl = slots_[s];
  SlotState st = sl.load();
  STRATA_ASSERT(st == SlotState::Queued || st == SlotState::Reading || st == SlotState::Complete,
                "park takes queued, reading or complete slots");
  if (st == SlotState::Queued) {
    // No part has begun: drop its jobs now; revive() re-queues them if the expert returns.
    queue_.drop_slot(s);
    sl.parts_total = std::uint16_t(n_parts_);
    sl.parts_started = sl.parts_done = 0;
    ++sl.gen;
  } else if (st == SlotState::Reading) {
    // Nobody chose this expert: the parts that have not begun are not read (they would only take
    // the SSD from work someone needs). Those in flight finish; release_limbo waits for them (I7).
    queue_.drop_slot(s, &sl.unread);
  }
  unpublish(s);
  sl.state.store(SlotState::Limbo, std::memory_order_release);
  limbo_.push_back(s);
  stats_.limbo.fetch_add(1, std::memory_order_relaxed);
}

void ExpertStream::revive(std::uint32_t s, ReadClass cls) {
  Slot& sl = slots_[s];
  STRATA_ASSERT(sl.load() == SlotState::Limbo, "revive takes a limbo slot");
  limbo_.erase(std::find(limbo_.begin(), limbo_.end(), s));
  sl.cls = cls;
  stats_.revived.fetch_add(1, std::memory_order_relaxed);
  if (sl.parts_started == 0) {
    sl.state.store(SlotState::Queued, std::memory_order_release);
    enqueue_parts(s);
  } else if (!sl.unread.empty()) {
    // Parked while reading: queue the parts park() took back, as the class now asking.
    sl.state.store(SlotState::Reading, std::memory_order_release);
    if (cls == ReadClass::Urgent) queue_.promote(s, cls);
    for (std::uint16_t p : sl.unread) queue_.push(IoJob{s, sl.gen, p, cls});
    sl.unread.clear();
    wake_io_.store(true, std::memory_order_relaxed);
  } else if (!sl.reads_finished()) {
    sl.state.store(SlotState::Reading, std::memory_order_release);
    if (cls == ReadClass::Urgent) queue_.promote(s, cls);
  } else if (sl.failed_part) {
    sl.state.store(SlotState::Failed, std::memory_order_release);
  } else {
    sl.state.store(SlotState::Complete, std::memory_order_release);
  }
}

void ExpertStream::make_urgent(std::uint32_t s) {
  Slot& sl = slots_[s];
  if (sl.cls != ReadClass::Urgent) {
    sl.cls = ReadClass::Urgent;
    queue_.promote(s, ReadClass::Urgent);
  }
  if (!sl.used) {
    sl.used = true;
    stats_.spec_hits.fetch_add(1, std::memory_order_relaxed);
    heat_.on_covered_miss(sl.key);
  }
}

// ---- lifecycle primitives ------------------------------------------------------------------

bool ExpertStream::cancel(std::uint32_t layer, std::uint32_t expert) {
  check_layer(layer);
  if (expert >= layout().n_experts) throw std::out_of_range("expert out of range");
  std::lock_guard<std::mutex> lk(mu_);
  require_open();
  std::int32_t s = where_[layer * layout().n_experts + expert];
  if (s < 0) return false;
  Slot& sl = slots_[std::uint32_t(s)];
  if (sl.load() != SlotState::Queued || sl.parts_started != 0) return false;  // I6
  recycle(std::uint32_t(s));
  stats_.cancelled.fetch_add(1, std::memory_order_relaxed);
  return true;
}

std::uint32_t ExpertStream::retire_unused_pre(std::uint32_t layer, const std::int32_t* chosen,
                                              std::size_t n) {
  check_layer(layer);
  std::lock_guard<std::mutex> lk(mu_);
  require_open();
  return retire_locked(layer, chosen, n);
}

std::uint32_t ExpertStream::retire_locked(std::uint32_t layer, const std::int32_t* chosen,
                                          std::size_t n) {
  const std::uint32_t E = layout().n_experts;
  // The chosen experts' marks, in a buffer kept zero between calls (no allocation per layer).
  std::vector<char>& keep = retire_keep_;
  keep.resize(E, 0);
  for (std::size_t i = 0; i < n; ++i)
    if (chosen[i] >= 0 && std::uint32_t(chosen[i]) < E) keep[std::uint32_t(chosen[i])] = 1;
  std::uint32_t parked = 0;
  for (std::uint32_t e = 0; e < E; ++e) {
    if (keep[e]) {
      keep[e] = 0;
      continue;
    }
    std::int32_t s = where_[layer * E + e];
    if (s < 0) continue;
    Slot& sl = slots_[std::uint32_t(s)];
    SlotState st = sl.load();
    if (sl.cls == ReadClass::Urgent || sl.used || sl.pins) continue;
    if (st != SlotState::Queued && st != SlotState::Reading && st != SlotState::Complete) continue;
    park(std::uint32_t(s));
    ++parked;
  }
  return parked;
}

std::uint32_t ExpertStream::release_limbo() {
  std::lock_guard<std::mutex> lk(mu_);
  return release_limbo_locked();
}

std::uint32_t ExpertStream::release_limbo_locked() {
  std::vector<std::uint32_t> done;
  for (std::uint32_t s : limbo_) {
    const Slot& sl = slots_[s];
    if (sl.limbo_releasable()) done.push_back(s);
  }
  for (std::uint32_t s : done) recycle(s);
  stats_.limbo_released.fetch_add(done.size(), std::memory_order_relaxed);
  return std::uint32_t(done.size());
}

}  // namespace strata
