// The arena's device-memory mirror (STRATA_CUDA_ARENA=device, docs/cuda.md): slot for slot a
// copy of the stream's host arena in HBM, each mirror slot tagged with the key whose bytes it
// holds. Filled at IO completion: as the stream's record observer (residency/record_observer.h)
// it copies each completed record into its mirror slot on a copy stream and waits for that
// copy, on the IO thread, before the stream may publish the record ("publication implies device
// bytes"), so the IO threads' preads overlap the copies and no pass waits for one. A published
// slot whose tag does not match (read before the backend registered) is still copied by the
// device thread, on the kernels' stream before the pass (ensure()): the fallback.
//
// Concurrency.
// - mu_ (shared) guards the allocation (device bytes, tags, sizes): allocate() holds it
//   exclusively (from bind(), while the device thread is idle); on_record_complete holds it
//   shared for its whole copy, so a reallocation waits for the copies in flight. The device
//   thread reads the allocation without mu_: bind() ordered it (the backend's queue lock).
// - tags_[slot]: one atomic per slot, stores release, loads acquire. Two writers, never at once
//   for one slot: an IO thread for a slot being read (not published, not pinned: no pass reads
//   it, I1, I8), the device thread for a slot a pass reads (published: complete, no read in
//   flight). A slot changes hands only through a recycle, which happens only after the Signal
//   that drained every kernel that read it (I4), so a copy-stream write into a recycled slot
//   never races a queued kernel or the kernels' stream's own copy into it.
// - lanes_mu_ guards the copy lanes (a stream and its event); an IO thread holds one lane for
//   the duration of its copy, so there are at most as many as IO threads ever copied at once.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <vector>

#include "residency/record_observer.h"

namespace strata::cuda {

class ArenaMirror final : public RecordObserver {
 public:
  ArenaMirror() = default;
  ArenaMirror(const ArenaMirror&) = delete;
  ArenaMirror& operator=(const ArenaMirror&) = delete;
  ~ArenaMirror() override;

  // Device memory for n_slots x slot_bytes, every tag cleared (nothing mirrored). Throws
  // std::runtime_error naming the CUDA error. Waits for the copies in flight.
  void allocate(std::uint32_t n_slots, std::uint64_t slot_bytes, std::uint64_t record_bytes);
  const unsigned char* device() const { return device_; }

  // Copy each part as it lands (STRATA_CUDA_MIRROR_FILL=parts) instead of the whole record
  // after its last part: set before the mirror is registered with a stream.
  void copy_parts(bool on) { copy_parts_ = on; }

  // The IO thread's copy of one part (copy_parts): its bytes into their place in the mirror slot
  // on a copy lane, waited for, then counted for the read `part.gen` of the slot; the slot's tag
  // is cleared first. So the copies of a record's parts run beside its other parts' reads, and
  // after its last part only that part's copy is left. Throws std::runtime_error naming the
  // CUDA error.
  void on_part_read(const ReadPart& part) override;
  // The IO thread's copy: record.bytes (registered, pinned host memory) into the record's mirror
  // slot on a copy lane, waited for, then the slot tagged with record.key. With copy_parts, when
  // every part of this read was copied already, only the tag is set. Throws
  // std::runtime_error naming the CUDA error (the stream makes it the record's read error).
  void on_record_complete(const CompletedRecord& record) override;

  // The device thread, for a published slot a pass is about to read: true when its mirror
  // already holds `key`; else queues the copy from host_arena on `stream` (before the pass's
  // kernels), tags the slot and returns false. Throws std::runtime_error naming the CUDA error.
  bool ensure(std::uint32_t slot, std::uint32_t key, const unsigned char* host_arena,
              cudaStream_t stream);

  std::uint64_t copies_at_completion() const {
    return at_completion_.load(std::memory_order_relaxed);
  }
  std::uint64_t copies_lazy() const { return lazy_.load(std::memory_order_relaxed); }
  std::uint64_t part_copies() const { return parts_.load(std::memory_order_relaxed); }
  // The IO threads' time in on_record_complete: queueing the copy, and waiting for it (ns).
  std::uint64_t issue_ns() const { return issue_ns_.load(std::memory_order_relaxed); }
  std::uint64_t wait_ns() const { return wait_ns_.load(std::memory_order_relaxed); }

 private:
  struct Lane {
    cudaStream_t stream = nullptr;
    cudaEvent_t done = nullptr;
  };
  Lane take_lane();
  void give_lane(const Lane& lane);
  void release();
  // Copies `size` host bytes to `offset` in the mirror on a copy lane and waits for it.
  void copy_and_wait(const unsigned char* host, std::uint64_t offset, std::uint64_t size);

  std::shared_mutex mu_;
  unsigned char* device_ = nullptr;                      // mu_
  std::unique_ptr<std::atomic<std::uint32_t>[]> tags_;  // mu_ (the array); entries: see above
  // mu_ (the array); entries: the parts copied of one read of the slot, (gen << 32) | count,
  // updated by the IO threads reading its parts (compare-exchange), read by the one that
  // completes the record, after every part counted done (the stream's lock orders them).
  std::unique_ptr<std::atomic<std::uint64_t>[]> parts_copied_;
  std::uint32_t n_slots_ = 0;                            // mu_
  std::uint64_t slot_bytes_ = 0, record_bytes_ = 0;      // mu_
  std::mutex lanes_mu_;
  std::vector<Lane> free_lanes_, all_lanes_;  // lanes_mu_
  // Counts and times, for STRATA_CUDA_TRACE (relaxed: read when the backend goes).
  std::atomic<std::uint64_t> at_completion_{0}, lazy_{0}, issue_ns_{0}, wait_ns_{0}, parts_{0};
  bool copy_parts_ = false;  // set before registration, then read only
};

}  // namespace strata::cuda
