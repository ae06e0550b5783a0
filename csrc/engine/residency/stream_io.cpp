// The IO threads: one pread per part straight into the slot's bytes and that part's checksum;
// the record's check and completion after its last part.
#include "residency/expert_stream.h"

#include <algorithm>
#include <chrono>
#include <exception>
#include <string>
#include <thread>

#include "common/check.h"
#include "common/errors.h"
#include "common/timing.h"
#include "pack/checksum.h"
#include "residency/fault_injection.h"
#include "residency/stream_testing.h"

namespace strata {

void ExpertStream::io_exited() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    --live_io_;
  }
  exit_cv_.notify_all();
}

void ExpertStream::io_loop() {
  Lock lk(mu_);
  // A record finished by the last job: its waiters are woken at this thread's next release of
  // mu_ (before its next pread, or before it sleeps), not by a release and retake of their own.
  bool done_owed = false;
  bool may_spin = true;  // one spin an idle spell: a spin that found nothing sleeps next
  for (;;) {
    while (!closing_ && queue_.empty()) {
      if (done_owed) {
        done_owed = false;
        lk.unlock();
        done_cv_.notify_all();
        lk.lock();
        continue;  // the queue may have filled meanwhile
      }
      if (may_spin && opt_.io_spin_us > 0) {
        may_spin = false;
        lk.unlock();
        spin_for_jobs();
        lk.lock();
        continue;
      }
      ++io_sleeping_;
      io_cv_.wait(lk);
      --io_sleeping_;
      // This thread was one of them (or the host's, or spurious); never more than sleep.
      io_signalled_ = std::min(io_signalled_ - (io_signalled_ > 0 ? 1u : 0u), io_sleeping_);
    }
    if (closing_) break;
    may_spin = true;
    IoJob job = queue_.pop();
    // Fan out: wake as many sleeping threads as there are jobs left that no thread already
    // woken will take (after mu_ is released), so a record's parts start one wake after the
    // first, together, instead of one wake apart in a chain.
    const std::size_t untaken = queue_.size() - std::min<std::size_t>(queue_.size(), io_signalled_);
    const std::uint32_t asleep = io_sleeping_ - std::min(io_sleeping_, io_signalled_);
    const auto wake = std::uint32_t(std::min<std::size_t>(untaken, asleep));
    io_signalled_ += wake;
    execute_job(lk, job, wake, &done_owed);
  }
  if (done_owed) {
    lk.unlock();
    done_cv_.notify_all();
  }
}

void ExpertStream::spin_for_jobs() const {
  const auto until = Clock::now() + std::chrono::microseconds(opt_.io_spin_us);
  while (!queue_.maybe_nonempty() && Clock::now() < until) {
  }
}

std::chrono::nanoseconds ExpertStream::spin_for_slot(std::uint32_t s,
                                                     std::chrono::nanoseconds budget) const {
  const auto t0 = Clock::now();
  const Slot& sl = slots_[s];
  for (auto now = t0; now - t0 < budget; now = Clock::now()) {
    const SlotState st = sl.load();
    if (st != SlotState::Queued && st != SlotState::Reading) return now - t0;
  }
  return budget;
}

// One part read, as execute_job's steps pass it along.
struct ExpertStream::PartRead {
  std::uint32_t key = 0;
  bool speculative = false;  // as queued: promotion re-queues
  std::uint64_t rel = 0, len = 0, offset = 0;
  std::uint64_t record_bytes = 0;  // of the record's bytes in this part (the rest is padding)
  unsigned char* dst = nullptr;
  int err = 0;
  std::size_t got = 0;
  std::uint64_t read_ns = 0;
  Clock::time_point pread_end{};
  std::string cause;  // kObserverFailed: the observer's message
};

void ExpertStream::execute_job(Lock& lk, const IoJob& job, std::uint32_t wake,
                               bool* done_owed) {
  const auto job_start = Clock::now();
  const std::uint64_t job_cpu_start = thread_cpu_ns();
  PartRead part = begin_part(job, job_start);
  lk.unlock();
  for (std::uint32_t i = 0; i < wake; ++i) io_cv_.notify_one();
  if (done_owed && *done_owed) {
    *done_owed = false;
    done_cv_.notify_all();
  }
  read_part(job, part);
  check_part(job, part);
  lk.lock();
  count_part(job, part);
  Slot& sl = slots_[job.slot];
  if (!sl.failed_part && sl.parts_done + 1 == sl.parts_total) finish_record(lk, job, part);
  ++sl.parts_done;
  wake_part_waiters(lk, job.slot, done_owed);
  stats_.job_ns.fetch_add(ns_since(job_start), std::memory_order_relaxed);
  stats_.job_cpu_ns.fetch_add(thread_cpu_ns() - job_cpu_start, std::memory_order_relaxed);
}

// Under mu_: the slot starts reading (its miss timeline too), the part counts as started, and
// where its bytes go.
ExpertStream::PartRead ExpertStream::begin_part(const IoJob& job, Clock::time_point job_start) {
  Slot& sl = slots_[job.slot];
  STRATA_ASSERT(sl.gen == job.gen, "queued jobs are dropped when their slot is recycled");
  SlotState st = sl.load();
  STRATA_ASSERT(st == SlotState::Queued || st == SlotState::Reading || st == SlotState::Limbo,
                "a job runs only for a loading slot");
  if (st == SlotState::Queued) {
    sl.state.store(SlotState::Reading, std::memory_order_release);
    if (sl.miss.queued != Clock::time_point{}) sl.miss.first_part = job_start;
  }
  ++sl.parts_started;
  PartRead part;
  part.speculative = job.cls != ReadClass::Urgent;
  if (part.speculative) stats_.spec_parts_started.fetch_add(1, std::memory_order_relaxed);
  part.key = sl.key;
  part.rel = std::uint64_t(job.part) * part_bytes_;
  part.len = std::min<std::uint64_t>(part_bytes_, read_span_ - part.rel);
  part.offset = layout().record_offset(part.key) + part.rel;
  part.dst = arena_->slot(job.slot) + part.rel;
  const std::uint64_t record_bytes = layout().record_bytes;
  part.record_bytes =
      part.rel < record_bytes ? std::min(part.len, record_bytes - part.rel) : 0;
  return part;
}

// Without mu_: the pread (or an injected fault, or simulated IO).
void ExpertStream::read_part(const IoJob& job, PartRead& part) {
  Fault fault;
  const auto t0 = Clock::now();
  bool injected = faults_->take(part.key, job.part, &fault);
  if (injected && (fault.kind == FaultKind::Delay || fault.kind == FaultKind::Gate)) {
    if (fault.kind == FaultKind::Delay)
      std::this_thread::sleep_for(std::chrono::milliseconds(fault.delay_ms));
    else
      faults_->wait_gate(fault.delay_ms);
    injected = false;
  }
  if (injected)
    part.err = fault.kind == FaultKind::Errno ? fault.err : kShortRead;
  else if (opt_.simulate_io)
    part.got = std::size_t(part.len);
  else
    part.err = file_->read_fully(part.offset, part.dst, std::size_t(part.len), &part.got);
  part.pread_end = Clock::now();
  part.read_ns = ns_between(t0, part.pread_end);
}

// Without mu_, after a good read: this part's share of the record's CRC32C, here, in parallel
// with the other parts' reads (after the last part only its own CRC and the combines remain,
// not a pass over the whole record on a miss's path: benchmarks/miss_latency.py's "verify
// costs" column measures what is left); then the observers' share of this part (a backend's
// copy of it to the device). The part is still in flight, so nothing recycles the slot.
void ExpertStream::check_part(const IoJob& job, PartRead& part) {
  if (part.err != 0) return;
  if (!part_crc_.empty()) {
    const auto c0 = Clock::now();
    part_crc_[std::size_t(job.slot) * n_parts_ + job.part] =
        crc32c(part.dst, std::size_t(part.record_bytes));
    stats_.crc_ns.fetch_add(ns_since(c0), std::memory_order_relaxed);
  }
  if (part.record_bytes == 0) return;
  const auto o0 = Clock::now();
  const std::uint64_t record_bytes = layout().record_bytes;
  const auto parts = std::uint32_t((record_bytes + part_bytes_ - 1) / part_bytes_);
  if (!notify_observers(nullptr,
                        ReadPart{job.slot, part.key, job.gen, job.part, part.rel, part.dst,
                                 part.record_bytes, parts, part_bytes_},
                        &part.cause))
    part.err = kObserverFailed;
  stats_.observer_ns.fetch_add(ns_since(o0), std::memory_order_relaxed);
}

// Under mu_: the part's figures, and the slot's first failure.
void ExpertStream::count_part(const IoJob& job, PartRead& part) {
  Slot& sl = slots_[job.slot];
  if (part.speculative) stats_.spec_parts_done.fetch_add(1, std::memory_order_relaxed);
  stats_.read_ns.fetch_add(part.read_ns, std::memory_order_relaxed);
  stats_.bytes_read.fetch_add(part.got, std::memory_order_relaxed);
  if (part.err != 0 && !sl.failed_part) {
    sl.failed_part = true;
    sl.err = part.err;
    sl.err_offset = part.offset;
    sl.cause = std::move(part.cause);
  }
}

// The record's last part: check the CRC32C of the whole record, then hand its bytes to the
// record observers (a backend's device copy: record_observer.h), both before the part counts
// as done and with mu_ released (the CRC is a pass over the part's bytes, an observer may
// block on a copy, and every IO thread and the handshake need the lock). Until ++parts_done
// the part is in flight, so no recycle, eviction or limbo release touches the slot (I4, I7),
// and nothing publishes it (on_reads_finished runs after): I1 holds for the observers' copies
// too. park and revive may run meanwhile. Entered and left with mu_ held.
void ExpertStream::finish_record(Lock& lk, const IoJob& job, const PartRead& part) {
  Slot& sl = slots_[job.slot];
  sl.miss.last_pread = part.pread_end;
  const unsigned char* record = arena_->slot(job.slot);
  const std::uint64_t record_bytes = layout().record_bytes;
  const bool verify = !part_crc_.empty();
  lk.unlock();
  int why = 0;
  std::string cause;
  const auto c0 = Clock::now();
  const bool crc_ok = !verify || record_crc(job.slot) == file_->checksums()[part.key];
  const auto o0 = Clock::now();
  if (verify) stats_.crc_ns.fetch_add(ns_between(c0, o0), std::memory_order_relaxed);
  if (!crc_ok) {
    why = kChecksumMismatch;
  } else {
    const auto parts = std::uint32_t((record_bytes + part_bytes_ - 1) / part_bytes_);
    const CompletedRecord done{job.slot, part.key, record, record_bytes, job.gen, parts};
    if (!notify_observers(&done, ReadPart{}, &cause)) why = kObserverFailed;
    stats_.observer_ns.fetch_add(ns_since(o0), std::memory_order_relaxed);
  }
  const auto observed = Clock::now();
  lk.lock();
  sl.miss.observed = observed;
  if (why != 0 && !sl.failed_part) {
    sl.failed_part = true;
    sl.err = why;
    sl.err_offset = layout().record_offset(part.key);
    sl.cause = std::move(cause);
  }
}

// Under mu_, once the part counts as done. Waiters (wait, settle, an urgent request short of
// slots) care about whole records and about a parked slot's last read in flight, not about
// every part: waking them per part cost the host a futex round trip, and the IO threads the
// lock it then held while rescanning. With `done_owed` (the IO threads' loop) the wake is
// left to the caller's next release of mu_.
void ExpertStream::wake_part_waiters(Lock& lk, std::uint32_t s, bool* done_owed) {
  const Slot& sl = slots_[s];
  bool notify = false;
  if (sl.reads_finished()) {
    on_reads_finished(s);
    notify = true;
  } else if (!sl.in_flight() && sl.load() == SlotState::Limbo) {
    notify = true;
  }
  if (notify && done_owed) {
    *done_owed = true;
  } else if (notify) {
    lk.unlock();
    done_cv_.notify_all();
    lk.lock();
  }
}

std::uint32_t ExpertStream::record_crc(std::uint32_t s) const {
  const std::uint64_t record_bytes = layout().record_bytes;
  const std::uint32_t* crc = part_crc_.data() + std::size_t(s) * n_parts_;
  std::uint32_t whole = crc[0];
  for (std::uint32_t p = 1; p < n_parts_; ++p) {
    const std::uint64_t rel = std::uint64_t(p) * part_bytes_;
    if (rel >= record_bytes) break;  // the alignment padding's parts hold no record bytes
    const std::uint64_t n = std::min<std::uint64_t>(part_bytes_, record_bytes - rel);
    whole = crc32c_combine(whole, crc[p], n);
  }
  return whole;
}

void ExpertStream::count_miss_times(const Slot::MissTimes& t) {
  const Clock::time_point unset{};
  if (t.queued == unset || t.first_part == unset || t.last_pread == unset || t.observed == unset)
    return;  // not urgent from its start (a promoted speculative read), or no part seen whole
  stats_.miss_timed.fetch_add(1, std::memory_order_relaxed);
  stats_.miss_queued_ns.fetch_add(ns_between(t.queued, t.first_part), std::memory_order_relaxed);
  stats_.miss_read_ns.fetch_add(ns_between(t.first_part, t.last_pread), std::memory_order_relaxed);
  stats_.miss_finish_ns.fetch_add(ns_between(t.last_pread, t.observed), std::memory_order_relaxed);
  stats_.miss_publish_ns.fetch_add(ns_since(t.observed), std::memory_order_relaxed);
}

void ExpertStream::on_reads_finished(std::uint32_t s) {
  Slot& sl = slots_[s];
  if (sl.load() == SlotState::Limbo) return;  // release_limbo recycles it
  STRATA_ASSERT(sl.load() == SlotState::Reading, "reads finish on a reading slot");
  if (sl.failed_part) {
    if (sl.cls == ReadClass::Urgent) {
      sl.state.store(SlotState::Failed, std::memory_order_release);  // wait() reports it
    } else {
      stats_.spec_failed.fetch_add(1, std::memory_order_relaxed);  // dropped, counted
      if (sl.pins == 0) recycle(s);
      else sl.state.store(SlotState::Failed, std::memory_order_release);
    }
    return;
  }
  // Release order: the bytes written by every part's pread happen-before this store.
  sl.state.store(SlotState::Complete, std::memory_order_release);
  stats_.reads_completed.fetch_add(1, std::memory_order_relaxed);
  // I2: only urgent completions publish from the IO side; speculation waits for publish(l).
  if (sl.cls == ReadClass::Urgent) {
    publish_slot(s);
    count_miss_times(sl.miss);
  }
}

bool ExpertStream::notify_observers(const CompletedRecord* record, const ReadPart& part,
                                    std::string* cause) {
  std::unique_lock<std::mutex> ol(observers_mu_);
  // The entry being called stays in the list (remove_observer waits for its calls to end), and
  // the iterator only moves with observers_mu_ held, so others may come and go meanwhile.
  for (auto it = observers_.begin(); it != observers_.end(); ++it) {
    if (it->removed) continue;
    ++it->calls;
    ol.unlock();
    bool ok = true;
    try {
      if (record)
        it->observer->on_record_complete(*record);
      else
        it->observer->on_part_read(part);
    } catch (const std::exception& e) {
      *cause = e.what();
      ok = false;
    } catch (...) {
      *cause = "unknown exception";
      ok = false;
    }
    ol.lock();
    if (--it->calls == 0 && it->removed) observers_cv_.notify_all();
    if (!ok) return false;
  }
  return true;
}

ObserverId ExpertStream::add_observer(RecordObserver* observer) {
  if (!observer) throw EngineError(ErrorKind::Config, "add_observer: a null observer");
  std::lock_guard<std::mutex> ol(observers_mu_);
  const ObserverId id{next_observer_++};
  observers_.push_back(ObserverEntry{id, observer});
  return id;
}

void ExpertStream::remove_observer(ObserverId id) {
  std::unique_lock<std::mutex> ol(observers_mu_);
  auto it = std::find_if(observers_.begin(), observers_.end(),
                         [&](const ObserverEntry& e) { return e.id == id && !e.removed; });
  if (it == observers_.end()) return;
  it->removed = true;  // no call starts from now on
  observers_cv_.wait(ol, [&] { return it->calls == 0; });
  observers_.erase(it);
}

std::size_t ExpertStream::n_observers() const {
  std::lock_guard<std::mutex> ol(observers_mu_);
  std::size_t n = 0;
  for (const ObserverEntry& e : observers_) n += !e.removed;
  return n;
}

std::vector<JobInfo> ExpertStream::pending_jobs() const {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<JobInfo> out;
  for (const IoJob& j : queue_.snapshot())
    out.push_back(JobInfo{j.slot, slots_[j.slot].key, j.part, j.cls});
  return out;
}

bool ExpertStream::run_job(std::size_t index) {
  Lock lk(mu_);
  require_open();
  if (!threads_.empty())
    throw EngineError(ErrorKind::Config, "run_job is for manual IO (io_threads = 0)");
  if (index >= queue_.size()) return false;
  IoJob job = queue_.take(index);
  execute_job(lk, job);
  return true;
}

}  // namespace strata
