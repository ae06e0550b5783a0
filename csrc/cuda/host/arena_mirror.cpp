#include "arena_mirror.h"

#include <chrono>
#include <stdexcept>
#include <string>

#include "residency/slot.h"

namespace strata::cuda {
namespace {

void check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  cudaGetLastError();
  throw std::runtime_error(std::string("cuda: ") + what + ": " + cudaGetErrorName(e) + " (" +
                           cudaGetErrorString(e) + ")");
}

}  // namespace

ArenaMirror::~ArenaMirror() {
  release();
  for (const Lane& l : all_lanes_) {
    cudaEventDestroy(l.done);
    cudaStreamDestroy(l.stream);
  }
  cudaGetLastError();
}

void ArenaMirror::release() {
  if (device_) cudaFree(device_);
  device_ = nullptr;
  tags_.reset();
  parts_copied_.reset();
  n_slots_ = 0;
}

void ArenaMirror::allocate(std::uint32_t n_slots, std::uint64_t slot_bytes,
                           std::uint64_t record_bytes) {
  std::unique_lock<std::shared_mutex> lk(mu_);  // waits out the copies in flight
  release();
  void* p = nullptr;
  const std::uint64_t bytes = std::uint64_t(n_slots) * slot_bytes;
  check(cudaMalloc(&p, bytes ? bytes : 4), "cudaMalloc (the arena's device mirror)");
  device_ = static_cast<unsigned char*>(p);
  tags_ = std::make_unique<std::atomic<std::uint32_t>[]>(n_slots);
  parts_copied_ = std::make_unique<std::atomic<std::uint64_t>[]>(n_slots);
  for (std::uint32_t s = 0; s < n_slots; ++s) {
    tags_[s].store(kNoKey, std::memory_order_relaxed);
    parts_copied_[s].store(0, std::memory_order_relaxed);
  }
  n_slots_ = n_slots;
  slot_bytes_ = slot_bytes;
  record_bytes_ = record_bytes;
}

ArenaMirror::Lane ArenaMirror::take_lane() {
  std::lock_guard<std::mutex> lk(lanes_mu_);
  if (free_lanes_.empty()) {
    Lane l;
    check(cudaStreamCreateWithFlags(&l.stream, cudaStreamNonBlocking), "cudaStreamCreate (copy)");
    const cudaError_t e = cudaEventCreateWithFlags(&l.done, cudaEventDisableTiming);
    if (e != cudaSuccess) cudaStreamDestroy(l.stream);
    check(e, "cudaEventCreate (copy)");
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

void ArenaMirror::copy_and_wait(const unsigned char* host, std::uint64_t offset,
                                std::uint64_t size) {
  const auto t0 = std::chrono::steady_clock::now();
  check(cudaSetDevice(0), "cudaSetDevice (IO thread)");
  const Lane lane = take_lane();
  struct GiveBack {
    ArenaMirror* m;
    Lane l;
    ~GiveBack() { m->give_lane(l); }
  } give_back{this, lane};
  check(cudaMemcpyAsync(device_ + offset, host, size, cudaMemcpyHostToDevice, lane.stream),
        "slot copy at IO completion");
  check(cudaEventRecord(lane.done, lane.stream), "cudaEventRecord (slot copy)");
  const auto t1 = std::chrono::steady_clock::now();
  // The IO thread waits here (its preads, other threads', overlap the copy): the record is
  // published only once its device bytes are complete, so any kernel launched after that reads
  // them (a completed copy is visible to every later launch, on any stream).
  check(cudaEventSynchronize(lane.done), "slot copy at IO completion");
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
  if (!device_ || p.slot >= n_slots_) return;  // nothing to mirror into: the fallback copies
  if (p.offset + p.size > slot_bytes_)
    throw std::runtime_error("cuda: a record part ending at " + std::to_string(p.offset + p.size) +
                             " does not fit a mirror slot of " + std::to_string(slot_bytes_));
  // The slot's old bytes stop counting before this copy overwrites some of them (no pass reads
  // this slot while its read is in flight: see arena_mirror.h); every part clears it alike.
  tags_[p.slot].store(kNoKey, std::memory_order_release);
  copy_and_wait(p.bytes, std::uint64_t(p.slot) * slot_bytes_ + p.offset, p.size);
  // Counted for this read only: another generation's count starts again from this part.
  std::atomic<std::uint64_t>& done = parts_copied_[p.slot];
  const std::uint64_t gen = std::uint64_t(p.gen) << 32;
  std::uint64_t seen = done.load(std::memory_order_relaxed);
  while (!done.compare_exchange_weak(seen, (seen & ~0xFFFFFFFFull) == gen ? seen + 1 : gen + 1,
                                     std::memory_order_acq_rel, std::memory_order_relaxed)) {
  }
  parts_.fetch_add(1, std::memory_order_relaxed);
}

void ArenaMirror::on_record_complete(const CompletedRecord& r) {
  std::shared_lock<std::shared_mutex> lk(mu_);
  if (!device_ || r.slot >= n_slots_) return;  // nothing to mirror into: the fallback copies
  if (r.size > slot_bytes_)
    throw std::runtime_error("cuda: a record of " + std::to_string(r.size) +
                             " bytes does not fit a mirror slot of " +
                             std::to_string(slot_bytes_));
  // Every part of this read on the device already (each waited for before it counted done, and
  // the stream counts this record's last part after them): only the tag is left.
  const bool copied = copy_parts_ && parts_copied_[r.slot].load(std::memory_order_acquire) ==
                                         ((std::uint64_t(r.gen) << 32) | r.parts);
  if (!copied) {
    // The slot's old bytes stop counting before the copy overwrites them (no pass reads this
    // slot while its read is in flight: see arena_mirror.h).
    tags_[r.slot].store(kNoKey, std::memory_order_release);
    copy_and_wait(r.bytes, std::uint64_t(r.slot) * slot_bytes_, r.size);
  }
  tags_[r.slot].store(r.key, std::memory_order_release);
  at_completion_.fetch_add(1, std::memory_order_relaxed);
}

bool ArenaMirror::ensure(std::uint32_t slot, std::uint32_t key, const unsigned char* host_arena,
                         cudaStream_t stream) {
  if (slot >= n_slots_) return true;  // not a slot: the grouping reports it
  if (tags_[slot].load(std::memory_order_acquire) == key) return true;
  const std::uint64_t off = std::uint64_t(slot) * slot_bytes_;
  check(cudaMemcpyAsync(device_ + off, host_arena + off, record_bytes_, cudaMemcpyHostToDevice,
                        stream),
        "slot copy");
  // Queued before the pass's kernels on their stream: they see it. Records never change, so
  // the tag stands until an IO completion for another key retags the slot.
  tags_[slot].store(key, std::memory_order_release);
  lazy_.fetch_add(1, std::memory_order_relaxed);
  return false;
}

}  // namespace strata::cuda
