// Requests and the blocking calls: request, wait and settle, and the one bounded wait they share.
#include "residency/expert_stream.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <sstream>
#include <stdexcept>

#include "common/check.h"
#include "common/errors.h"

namespace strata {

RequestResult ExpertStream::request(ClientId who, std::uint32_t layer,
                                    const std::int32_t* experts, std::size_t n, ReadClass cls,
                                    const InterruptCheck& interrupt, std::uint32_t max_new) {
  IoWaker waker{this};
  Lock lk(mu_);
  require_open();
  return request_locked(lk, who, layer, experts, n, cls, interrupt, max_new);
}


// What a request holds while it runs, released on every way out (an interrupt may throw while
// mu_ is released: both are undone under mu_ regardless).
struct ExpertStream::RequestGuards {
  ExpertStream& self;
  Lock& lk;
  ClientId who;
  // This client's waiting-for-space flag (another_client_may_release reads it).
  bool waiting = false;
  // An urgent request never evicts an expert it already holds in this call (a later expert
  // could otherwise pick an earlier, unprotected one as its victim): each resident slot it
  // touches is pinned, as a plan pins (I8), until the request returns.
  std::vector<std::uint32_t> pins;

  void set_waiting(bool v) {  // under mu_
    auto it = self.clients_.find(who);
    if (it != self.clients_.end()) it->second.waiting_for_space = v;
    waiting = v;
  }
  ~RequestGuards() {
    if (!waiting && pins.empty()) return;
    const bool held = lk.owns_lock();
    if (!held) lk.lock();
    if (waiting) set_waiting(false);
    for (std::uint32_t s : pins) --self.slots_[s].pins;
    if (!held) lk.unlock();
  }
};

RequestResult ExpertStream::request_locked(Lock& lk, ClientId who, std::uint32_t layer,
                                           const std::int32_t* experts, std::size_t n,
                                           ReadClass cls, const InterruptCheck& interrupt,
                                           std::uint32_t max_new) {
  check_experts(layer, experts, n);
  client_locked(who);  // registered (a closed Window's client is not)
  RequestGuards guards{*this, lk, who};
  const std::uint32_t E = layout().n_experts;
  const bool speculative = cls != ReadClass::Urgent;
  RequestResult r;
  std::optional<ReadProgress> progress;  // from the first wait for a slot
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint32_t key = layer * E + std::uint32_t(experts[i]);
    if (speculative)
      heat_.on_predicted(key);
    else
      heat_.on_use(key);
    bool placed = false;
    while (!placed) {
      if (hold_resident(key, cls, r, guards)) break;
      if (r.misses + r.spec_started >= max_new) return finish_request(cls, r);  // new reads only
      placed = start_read(key, cls, r, guards);
      if (placed) break;
      if (speculative) {  // I9: no space, so prediction stops here
        r.dropped = std::uint32_t(n - i);
        stats_.spec_dropped.fetch_add(n - i, std::memory_order_relaxed);
        return finish_request(cls, r);
      }
      wait_for_space(lk, guards, layer, experts[i], progress, interrupt);
    }
  }
  return finish_request(cls, r);
}

// The key's slot, if it has one that serves: a limbo slot revives, a failed one is recycled for
// an urgent retry (a failed read is not reported twice). An urgent request pins, promotes and
// publishes what it finds (a speculative read that completed before this handshake).
bool ExpertStream::hold_resident(std::uint32_t key, ReadClass cls, RequestResult& r,
                                 RequestGuards& guards) {
  const std::int32_t s = where_[key];
  if (s < 0) return false;
  const bool speculative = cls != ReadClass::Urgent;
  Slot& sl = slots_[std::uint32_t(s)];
  if (sl.load() == SlotState::Limbo) revive(std::uint32_t(s), cls);
  if (sl.load() == SlotState::Failed && !speculative) {
    recycle(std::uint32_t(s));
    return false;
  }
  touch(std::uint32_t(s));
  if (speculative) return true;
  ++sl.pins;
  guards.pins.push_back(std::uint32_t(s));
  make_urgent(std::uint32_t(s));
  if (sl.load() == SlotState::Complete) publish_slot(std::uint32_t(s));
  ++r.hits;
  return true;
}

// A new read of `key` into a slot take_slot() finds; false when there is none.
bool ExpertStream::start_read(std::uint32_t key, ReadClass cls, RequestResult& r,
                              RequestGuards& guards) {
  const bool speculative = cls != ReadClass::Urgent;
  const std::int32_t slot = take_slot(speculative);
  if (slot < 0) return false;
  if (guards.waiting) guards.set_waiting(false);
  assign(std::uint32_t(slot), key, cls);
  if (speculative) {
    ++r.spec_started;
    stats_.spec_requests.fetch_add(1, std::memory_order_relaxed);
  } else {
    ++r.misses;
    heat_.on_stalled_miss(key);
  }
  return true;
}

// Urgent and every slot busy: one bounded wait step for a read in flight to land, or for another
// client (a Window on another thread) to move past the protections that hold the arena. Throws
// when nothing can free a slot: ArenaFull, or Closed while the clients close.
void ExpertStream::wait_for_space(Lock& lk, RequestGuards& guards, std::uint32_t layer,
                                  std::int32_t expert, std::optional<ReadProgress>& progress,
                                  const InterruptCheck& interrupt) {
  bool something_moves = false;
  for (const auto& sl : slots_) {
    SlotState st = sl.load();
    if (sl.in_flight() || st == SlotState::Queued || st == SlotState::Reading) {
      something_moves = true;
      break;
    }
  }
  if (closing_clients_ && !something_moves)
    throw EngineError(ErrorKind::Closed, "the ExpertStream is closing: no Window will release "
                                         "a slot for this read");
  const bool others_may_release = another_client_may_release(guards.who);
  if ((!something_moves || threads_.empty()) && !others_may_release)
    throw EngineError(ErrorKind::ArenaFull, describe_full(guards.who));
  if (!progress) progress = read_progress();
  guards.set_waiting(true);
  lk.unlock();
  wake_io();
  lk.lock();
  // Another Window releasing a slot wakes this wait (done_cv_) and the caller's loop takes the
  // slot; one that holds its protections that long without any read landing is named in the
  // ArenaFull error.
  bounded_wait_step(lk, *progress, interrupt, [&] {
    if (!something_moves)
      return EngineError(ErrorKind::ArenaFull,
                         "waited " + std::to_string(opt_.io_timeout_s) +
                             " s (io_timeout_s) with no read progress for another window to "
                             "release a slot; " + describe_full(guards.who));
    return EngineError(ErrorKind::Timeout,
                       "timed out after " + std::to_string(opt_.io_timeout_s) +
                           " s with no read progress waiting for a free arena slot for layer " +
                           std::to_string(layer) + " expert " + std::to_string(expert));
  });
}

RequestResult ExpertStream::finish_request(ReadClass cls, const RequestResult& r) {
  if (cls == ReadClass::Urgent) {
    stats_.hits.fetch_add(r.hits, std::memory_order_relaxed);
    stats_.misses.fetch_add(r.misses, std::memory_order_relaxed);
  }
  return r;
}

void ExpertStream::throw_read_error(std::uint32_t s) {
  Slot& sl = slots_[s];
  const std::uint32_t E = layout().n_experts;
  std::uint32_t layer = sl.key / E, expert = sl.key % E;
  int err = sl.err;
  std::uint64_t off = sl.err_offset;
  std::ostringstream m;
  m << "expert read failed: layer " << layer << " expert " << expert << " at file offset " << off
    << " of " << file_->path() << ": ";
  if (err > 0)
    m << std::strerror(err) << " (errno " << err << ")";
  else if (err == kChecksumMismatch)
    m << "checksum mismatch: the record read fails its CRC32C (the file changed on disk or is "
         "corrupt) (errno 0)";
  else if (err == kObserverFailed)
    m << "the record was read but a backend could not take it at IO completion: " << sl.cause
      << " (errno 0)";
  else
    m << "short read (errno 0)";
  recycle(s);
  stats_.failed.fetch_add(1, std::memory_order_relaxed);
  throw ExpertReadError(m.str(), int(layer), int(expert), off, err > 0 ? err : 0);
}

ExpertStream::ReadProgress ExpertStream::read_progress() const {
  return ReadProgress{Clock::now(), stats_.bytes_read.load(std::memory_order_relaxed)};
}

void ExpertStream::bounded_wait_step(Lock& lk, ReadProgress& p, const InterruptCheck& interrupt,
                                     const std::function<EngineError()>& timed_out) {
  done_cv_.wait_for(lk, std::chrono::milliseconds(50));
  const std::uint64_t now_done = stats_.bytes_read.load(std::memory_order_relaxed);
  if (now_done != p.bytes_read) {
    p.bytes_read = now_done;
    p.at = Clock::now();
  } else if (Clock::now() - p.at > std::chrono::duration<double>(opt_.io_timeout_s)) {
    throw timed_out();
  }
  if (interrupt) {
    lk.unlock();
    interrupt();  // may throw: the caller's guards run with mu_ released
    lk.lock();
  }
  require_open();
}

// Anything of experts[0, n) not yet requested urgently (or dropped, or parked) is requested now.
void ExpertStream::request_unrequested(ClientId who, std::uint32_t layer,
                                       const std::int32_t* experts, std::size_t n,
                                       const InterruptCheck& interrupt) {
  const std::uint32_t E = layout().n_experts;
  std::vector<std::int32_t> missing;
  {
    std::lock_guard<std::mutex> lk(mu_);
    require_open();
    for (std::size_t i = 0; i < n; ++i) {
      std::int32_t s = where_[layer * E + std::uint32_t(experts[i])];
      if (s < 0 || slots_[std::uint32_t(s)].cls != ReadClass::Urgent ||
          slots_[std::uint32_t(s)].load() == SlotState::Limbo)
        missing.push_back(experts[i]);
    }
  }
  if (!missing.empty())
    request(who, layer, missing.data(), missing.size(), ReadClass::Urgent, interrupt);
}

// One pass over the waited-for experts, under mu_: the first one not yet complete (its slot,
// and whether its reads are still to finish), or all complete. A key recycled under us (another
// caller's urgent request) is requested again; a failed read throws; with manual IO the first
// incomplete slot's next queued part runs inline.
ExpertStream::WaitScan ExpertStream::scan_waited(Lock& lk, ClientId who, std::uint32_t layer,
                                                 const std::int32_t* experts, std::size_t n,
                                                 const InterruptCheck& interrupt) {
  const std::uint32_t E = layout().n_experts;
  WaitScan scan;
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint32_t key = layer * E + std::uint32_t(experts[i]);
    std::int32_t s = where_[key];
    if (s < 0) {
      lk.unlock();
      request(who, layer, &experts[i], 1, ReadClass::Urgent, interrupt);
      lk.lock();
      scan.all = false;
      return scan;
    }
    SlotState st = slots_[std::uint32_t(s)].load();
    if (st == SlotState::Failed && !slots_[std::uint32_t(s)].in_flight())
      throw_read_error(std::uint32_t(s));
    if (st != SlotState::Complete) {
      scan.all = false;
      scan.pending = std::uint32_t(s);
      scan.pending_reads = st == SlotState::Queued || st == SlotState::Reading;
      if (threads_.empty()) run_next_part_inline(lk, std::uint32_t(s));
      return scan;
    }
    STRATA_ASSERT(slots_[std::uint32_t(s)].published, "I1: waited-for urgent slot published");
  }
  return scan;
}

// Manual IO: runs slot s's next pending part inline, in queue order.
void ExpertStream::run_next_part_inline(Lock& lk, std::uint32_t s) {
  auto jobs = queue_.snapshot();
  for (std::size_t j = 0; j < jobs.size(); ++j)
    if (jobs[j].slot == s) {
      IoJob job = queue_.take(j);
      execute_job(lk, job);
      return;
    }
  throw EngineError(ErrorKind::Timeout, "manual IO: slot " + std::to_string(s) +
                                            " is loading but has no pending read");
}

void ExpertStream::wait(ClientId who, std::uint32_t layer, const std::int32_t* experts,
                        std::size_t n, const InterruptCheck& interrupt) {
  check_experts(layer, experts, n);
  request_unrequested(who, layer, experts, n, interrupt);
  Lock lk(mu_);
  // The time blocked counts as stall on every way out (done, failed read, timeout, interrupt).
  struct StallClock {
    StreamStats& stats;
    Clock::time_point t0 = Clock::now();
    bool blocked = false;
    ~StallClock() {
      if (blocked) stats.stall_ns.fetch_add(ns_since(t0), std::memory_order_relaxed);
    }
  } stall{stats_};
  ReadProgress progress = read_progress();
  // io_spin_us of spinning a call, in all: reads that land within it skip the futex wake-up.
  auto spin_left = std::chrono::nanoseconds(std::chrono::microseconds(opt_.io_spin_us));
  for (;;) {
    require_open();
    const WaitScan scan = scan_waited(lk, who, layer, experts, n, interrupt);
    if (scan.all) break;
    if (threads_.empty()) continue;
    stall.blocked = true;
    // A spin only on reads still to finish: a slot failing or parked is left to the blocking
    // step, which a spin on an unchanging state would only delay.
    if (spin_left.count() > 0 && scan.pending_reads) {
      lk.unlock();
      spin_left -= spin_for_slot(scan.pending, spin_left);
      lk.lock();
      continue;
    }
    bounded_wait_step(lk, progress, interrupt, [&] {
      return EngineError(ErrorKind::Timeout,
                         "timed out after " + std::to_string(opt_.io_timeout_s) +
                             " s with no read progress waiting for layer " + std::to_string(layer));
    });
  }
}

void ExpertStream::settle(const InterruptCheck& interrupt) {
  Lock lk(mu_);
  auto idle = [&] {
    if (!queue_.empty()) return false;
    for (const Slot& sl : slots_)
      if (sl.in_flight()) return false;
    return true;
  };
  ReadProgress progress = read_progress();
  for (;;) {
    require_open();
    if (threads_.empty()) {  // manual IO: run what is queued inline, in queue order
      while (!queue_.empty()) execute_job(lk, queue_.take(0));
      return;
    }
    if (idle()) return;
    bounded_wait_step(lk, progress, interrupt, [&] {
      return EngineError(ErrorKind::Timeout, "timed out after " + std::to_string(opt_.io_timeout_s) +
                                                 " s with no read progress settling the IO queue");
    });
  }
}

}  // namespace strata
