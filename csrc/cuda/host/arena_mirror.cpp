#include "arena_mirror.h"

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <string>

#include "common/check.h"
#include "cuda_check.h"
#include "residency/slot.h"

namespace strata::cuda {

ArenaMirror::~ArenaMirror() {
  // No IO thread calls in any more (the backend unregistered); copies may still be queued.
  try {
    wait_all_parts();
  } catch (const std::exception&) {  // a device error: nothing is left to copy into
  }
  release();
  for (const Lane& l : all_lanes_) {
    cudaEventDestroy(l.done);
    cudaStreamDestroy(l.stream);
  }
  for (const auto& [id, s] : part_lanes_) cudaStreamDestroy(s);
  for (cudaEvent_t e : all_events_) cudaEventDestroy(e);
  cudaGetLastError();
}

void ArenaMirror::release() {
  memory_.reset();
  tags_.reset();
  n_slots_ = 0;
}

void ArenaMirror::allocate(std::uint32_t n_slots, std::uint64_t slot_bytes,
                           std::uint64_t record_bytes) {
  std::unique_lock<std::shared_mutex> lk(mu_);  // waits out the copies being issued
  wait_all_parts();                              // and those queued before: into the old memory
  release();
  memory_.ensure(std::uint64_t(n_slots) * slot_bytes, "cudaMalloc (the arena's device mirror)");
  tags_ = std::make_unique<std::atomic<std::uint32_t>[]>(n_slots);
  for (std::uint32_t s = 0; s < n_slots; ++s) tags_[s].store(kNoKey, std::memory_order_relaxed);
  n_slots_ = n_slots;
  slot_bytes_ = slot_bytes;
  record_bytes_ = record_bytes;
}

ArenaMirror::Lane ArenaMirror::take_lane() {
  std::lock_guard<std::mutex> lk(lanes_mu_);
  if (free_lanes_.empty()) {
    Lane l;
    cuda_check(cudaStreamCreateWithFlags(&l.stream, cudaStreamNonBlocking),
               "cudaStreamCreate (copy)");
    const cudaError_t e = cudaEventCreateWithFlags(&l.done, cudaEventDisableTiming);
    if (e != cudaSuccess) cudaStreamDestroy(l.stream);
    cuda_check(e, "cudaEventCreate (copy)");
    all_lanes_.push_back(l);
    return l;
  }
  Lane l = free_lanes_.back();
  free_lanes_.pop_back();
  return l;
}

void ArenaMirror::give_lane(const Lane& lane) {
  std::lock_guard<std::mutex> lk(lanes_mu_);
  free_lanes_.push_back(lane);
}

cudaStream_t ArenaMirror::part_lane() {
  std::lock_guard<std::mutex> lk(lanes_mu_);
  auto [it, fresh] = part_lanes_.try_emplace(std::this_thread::get_id(), nullptr);
  if (fresh) {
    const cudaError_t e = cudaStreamCreateWithFlags(&it->second, cudaStreamNonBlocking);
    if (e != cudaSuccess) part_lanes_.erase(it);
    cuda_check(e, "cudaStreamCreate (part copies)");
  }
  return it->second;
}

void ArenaMirror::wait_parts(std::uint32_t slot, std::uint32_t first, std::uint32_t last,
                             [[maybe_unused]] std::uint32_t gen) {
  std::vector<PendingCopy> taken;
  {
    std::lock_guard<std::mutex> lk(pending_mu_);
    auto it = pending_.find(slot);
    if (it == pending_.end()) return;
    std::vector<PendingCopy>& chunks = it->second.chunks;
    for (std::uint32_t c = first; c < last && c < chunks.size(); ++c) {
      if (!chunks[c].done) continue;
      STRATA_ASSERT(gen == ~0u || chunks[c].gen == gen,
                    "a completing record's chunks were all queued by its own read");
      taken.push_back(chunks[c]);
      chunks[c] = PendingCopy{};
    }
  }
  cudaError_t first_error = cudaSuccess;
  for (const PendingCopy& c : taken) {
    const cudaError_t e = cudaEventSynchronize(c.done);
    if (first_error == cudaSuccess) first_error = e;
  }
  {
    std::lock_guard<std::mutex> lk(pending_mu_);
    for (const PendingCopy& c : taken) spare_events_.push_back(c.done);
  }
  cuda_check(first_error, "part copy to the device mirror");
}

bool ArenaMirror::all_chunks_queued(std::uint32_t slot, std::uint32_t gen) {
  std::lock_guard<std::mutex> lk(pending_mu_);
  auto it = pending_.find(slot);
  if (it == pending_.end()) return false;
  const SlotCopies& sc = it->second;
  if (sc.gen != gen || sc.n_chunks == 0 || sc.chunks.size() < sc.n_chunks) return false;
  for (std::uint32_t c = 0; c < sc.n_chunks; ++c)
    if (!sc.chunks[c].done || sc.chunks[c].gen != gen) return false;
  return true;
}

void ArenaMirror::wait_all_parts() {
  std::vector<std::uint32_t> slots;
  {
    std::lock_guard<std::mutex> lk(pending_mu_);
    for (const auto& [slot, parts] : pending_) slots.push_back(slot);
  }
  for (std::uint32_t s : slots) wait_parts(s, 0, ~0u);
}

void ArenaMirror::copy_and_wait(const unsigned char* host, std::uint64_t offset,
                                std::uint64_t size) {
  const auto t0 = std::chrono::steady_clock::now();
  cuda_check(cudaSetDevice(0), "cudaSetDevice (IO thread)");
  const Lane lane = take_lane();
  struct GiveBack {
    ArenaMirror* m;
    Lane l;
    ~GiveBack() { m->give_lane(l); }
  } give_back{this, lane};
  cuda_check(
      cudaMemcpyAsync(mirror_bytes() + offset, host, size, cudaMemcpyHostToDevice, lane.stream),
      "slot copy at IO completion");
  cuda_check(cudaEventRecord(lane.done, lane.stream), "cudaEventRecord (slot copy)");
  const auto t1 = std::chrono::steady_clock::now();
  // The IO thread waits here (its preads, other threads', overlap the copy): the record is
  // published only once its device bytes are complete, so any kernel launched after that reads
  // them (a completed copy is visible to every later launch, on any stream).
  cuda_check(cudaEventSynchronize(lane.done), "slot copy at IO completion");
  const auto t2 = std::chrono::steady_clock::now();
  using ns = std::chrono::nanoseconds;
  issue_ns_.fetch_add(std::uint64_t(std::chrono::duration_cast<ns>(t1 - t0).count()),
                      std::memory_order_relaxed);
  wait_ns_.fetch_add(std::uint64_t(std::chrono::duration_cast<ns>(t2 - t1).count()),
                     std::memory_order_relaxed);
}

void ArenaMirror::on_part_read(const ReadPart& p) {
  if (!copy_parts_) return;
  std::shared_lock<std::shared_mutex> lk(mu_);
  if (!mirror_bytes() || p.slot >= n_slots_) return;  // none to mirror into: the fallback copies
  if (p.offset + p.size > slot_bytes_)
    throw std::runtime_error("cuda: a record part ending at " + std::to_string(p.offset + p.size) +
                             " does not fit a mirror slot of " + std::to_string(slot_bytes_));
  STRATA_ASSERT(p.part < p.parts && p.offset == std::uint64_t(p.part) * p.part_bytes,
                "a part is told its record's split");
  // The slot's old bytes stop counting before a copy overwrites some of them (no pass reads
  // this slot while its read is in flight: see arena_mirror.h); every part clears it alike.
  tags_[p.slot].store(kNoKey, std::memory_order_release);
  // Count the part as landed; the last of its chunk to land copies the chunk. The parts of one
  // read all land before the slot's next read begins (a part counts as in flight until then),
  // so a new generation restarts the counts.
  const std::uint32_t per = parts_per_chunk(p.part_bytes);
  const std::uint32_t chunk = p.part / per;
  const std::uint32_t first = chunk * per, last = std::min(first + per, p.parts);
  {
    std::lock_guard<std::mutex> pl(pending_mu_);
    SlotCopies& sc = pending_[p.slot];
    if (sc.gen != p.gen) {
      sc.gen = p.gen;
      sc.n_chunks = (p.parts + per - 1) / per;
      sc.landed.assign(sc.n_chunks, 0);
    }
    STRATA_ASSERT(sc.landed[chunk] < last - first, "a part lands once a read");
    if (++sc.landed[chunk] < last - first) return;  // its chunk's other parts are being read
  }
  // A copy into this place from an earlier read of the slot (one that failed after queueing it)
  // lands before this one is queued, so it cannot overwrite this read's bytes.
  wait_parts(p.slot, chunk, chunk + 1);
  const std::uint64_t begin = std::uint64_t(first) * p.part_bytes;
  const std::uint64_t end = std::min(std::uint64_t(last) * p.part_bytes, record_bytes_);
  const unsigned char* host = p.bytes - p.offset + begin;  // the chunk's parts, contiguous
  const auto t0 = std::chrono::steady_clock::now();
  cuda_check(cudaSetDevice(0), "cudaSetDevice (IO thread)");
  const cudaStream_t lane = part_lane();
  cudaEvent_t copied = nullptr;
  {
    std::lock_guard<std::mutex> pl(pending_mu_);
    if (!spare_events_.empty()) {
      copied = spare_events_.back();
      spare_events_.pop_back();
    }
  }
  if (!copied) {
    cuda_check(cudaEventCreateWithFlags(&copied, cudaEventDisableTiming),
               "cudaEventCreate (part copy)");
    std::lock_guard<std::mutex> pl(pending_mu_);
    all_events_.push_back(copied);
  }
  cudaError_t e = cudaMemcpyAsync(mirror_bytes() + std::uint64_t(p.slot) * slot_bytes_ + begin,
                                  host, end - begin, cudaMemcpyHostToDevice, lane);
  if (e == cudaSuccess) e = cudaEventRecord(copied, lane);
  {
    std::lock_guard<std::mutex> pl(pending_mu_);
    if (e != cudaSuccess) {
      spare_events_.push_back(copied);
    } else {
      std::vector<PendingCopy>& chunks = pending_[p.slot].chunks;
      if (chunks.size() <= chunk) chunks.resize(std::size_t(chunk) + 1);
      chunks[chunk] = PendingCopy{copied, p.gen};
    }
  }
  cuda_check(e, "part copy to the device mirror");
  issue_ns_.fetch_add(std::uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                        std::chrono::steady_clock::now() - t0)
                                        .count()),
                      std::memory_order_relaxed);
  chunks_.fetch_add(1, std::memory_order_relaxed);
}

void ArenaMirror::on_record_complete(const CompletedRecord& r) {
  std::shared_lock<std::shared_mutex> lk(mu_);
  if (!mirror_bytes() || r.slot >= n_slots_) return;  // none to mirror into: the fallback copies
  if (r.size > slot_bytes_)
    throw std::runtime_error("cuda: a record of " + std::to_string(r.size) +
                             " bytes does not fit a mirror slot of " +
                             std::to_string(slot_bytes_));
  // Every chunk of this read queued already: wait for their copies, then tag.
  if (copy_parts_ && all_chunks_queued(r.slot, r.gen)) {
    const auto t0 = std::chrono::steady_clock::now();
    wait_parts(r.slot, 0, ~0u, r.gen);
    wait_ns_.fetch_add(std::uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                         std::chrono::steady_clock::now() - t0)
                                         .count()),
                       std::memory_order_relaxed);
  } else {
    // The slot's old bytes stop counting before the copy overwrites them (no pass reads this
    // slot while its read is in flight: see arena_mirror.h). Chunk copies of this read or an
    // earlier one land first, so none overwrites the whole copy.
    tags_[r.slot].store(kNoKey, std::memory_order_release);
    wait_parts(r.slot, 0, ~0u);
    copy_and_wait(r.bytes, std::uint64_t(r.slot) * slot_bytes_, r.size);
  }
  tags_[r.slot].store(r.key, std::memory_order_release);
  at_completion_.fetch_add(1, std::memory_order_relaxed);
}

bool ArenaMirror::ensure(std::uint32_t slot, std::uint32_t key, const unsigned char* host_arena,
                         cudaStream_t stream) {
  if (slot >= n_slots_) return true;  // not a slot: the grouping reports it
  if (tags_[slot].load(std::memory_order_acquire) == key) return true;
  // A part copy of a failed read of this slot may still be queued: it lands before this one.
  wait_parts(slot, 0, ~0u);
  const std::uint64_t off = std::uint64_t(slot) * slot_bytes_;
  cuda_check(cudaMemcpyAsync(mirror_bytes() + off, host_arena + off, record_bytes_,
                             cudaMemcpyHostToDevice, stream),
             "slot copy");
  // Queued before the pass's kernels on their stream: they see it. Records never change, so
  // the tag stands until an IO completion for another key retags the slot.
  tags_[slot].store(key, std::memory_order_release);
  lazy_.fetch_add(1, std::memory_order_relaxed);
  return false;
}

}  // namespace strata::cuda
