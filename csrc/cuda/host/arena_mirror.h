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
//   the duration of a whole-record copy, so there are at most as many as IO threads ever copied
//   at once. Chunk copies go on the part lanes (part_lane(): one stream per IO thread, by thread
//   id, created once under lanes_mu_), queued and not waited for.
// - pending_mu_ guards pending_ (per slot: a chunk copy queued and not yet waited for, by chunk:
//   its event and read generation, a completing record whose chunks are all there waiting for
//   them instead of copying itself whole; and how many parts of each chunk of the slot's
//   current read have landed) and the spare events. A chunk's entry is written by the IO thread
//   whose part completed the chunk and taken by the one completing the record, or by the next
//   read of the same chunk (after a failed read), or by the fallback, allocate() and the
//   destructor; whoever takes it waits for its event outside the lock. So a copy into a chunk's
//   place in a mirror slot is always complete before the next copy into it is queued, and
//   before the slot is tagged.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "device_memory.h"
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
  const unsigned char* device() const { return mirror_bytes(); }

  // Copy the record in chunks as their parts land (STRATA_CUDA_MIRROR_FILL=parts) instead of
  // whole after its last part: set before the mirror is registered with a stream. A chunk is
  // as many consecutive parts as fit `chunk_bytes` (at least one; 0: one part a chunk,
  // STRATA_CUDA_COPY_CHUNK_KIB). The copy engine serves copies one at a time whatever the
  // streams and spends a fixed time on each beside its bytes
  // (benchmarks/native/cuda_copy_engine.cu measures it), so a record copied as many small parts
  // holds it longer than the same bytes in a few chunks.
  void copy_parts(bool on, std::uint64_t chunk_bytes) {
    copy_parts_ = on;
    chunk_bytes_ = chunk_bytes;
  }

  // The IO thread's part (copy_parts): counted as landed for the read `part.gen` of the slot,
  // and, when it is the last of its chunk to land, the chunk's bytes copied into their place in
  // the mirror slot, queued on the thread's part lane and not waited for (the IO thread goes on
  // to its next pread, as the native reference does); the slot's tag is cleared first. A copy of
  // an earlier read into the same chunk is waited for before this one is queued. The host bytes
  // it reads stay put until the record completes: its last part counts as in flight until then,
  // or, after a failed read, until the slot's next read of the chunk, which waits for this copy
  // first. Throws std::runtime_error naming the CUDA error.
  void on_part_read(const ReadPart& part) override;
  // The IO thread's copy: record.bytes (registered, pinned host memory) into the record's mirror
  // slot on a copy lane, waited for, then the slot tagged with record.key. With copy_parts, when
  // every chunk of this read was queued already, it waits for those copies and sets the tag.
  // Either way the record's device bytes are complete when it returns, before the stream may
  // publish it. Throws std::runtime_error naming the CUDA error (the stream makes it the
  // record's read error).
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
  std::uint64_t chunk_copies() const { return chunks_.load(std::memory_order_relaxed); }
  // The IO threads' time in on_record_complete: queueing the copy, and waiting for it (ns).
  std::uint64_t issue_ns() const { return issue_ns_.load(std::memory_order_relaxed); }
  std::uint64_t wait_ns() const { return wait_ns_.load(std::memory_order_relaxed); }

 private:
  struct Lane {
    cudaStream_t stream = nullptr;
    cudaEvent_t done = nullptr;
  };
  struct PendingCopy {
    cudaEvent_t done = nullptr;  // recorded after the copy on its part lane
    std::uint32_t gen = 0;       // the read of the slot it belongs to
  };
  struct SlotCopies {
    std::vector<PendingCopy> chunks;     // by chunk: the copy queued and not yet waited for
    std::uint32_t gen = ~0u;             // the read whose parts `landed` counts
    std::uint32_t n_chunks = 0;          // that read's chunks
    std::vector<std::uint32_t> landed;   // by chunk: that read's parts landed so far
  };
  Lane take_lane();
  void give_lane(const Lane& lane);
  cudaStream_t part_lane();
  // Waits for the queued copies of `slot`'s chunks [first, last) (every chunk: last = ~0u) and
  // returns their events to the spares. `gen` (when not ~0u): the read they must belong to.
  void wait_parts(std::uint32_t slot, std::uint32_t first, std::uint32_t last,
                  std::uint32_t gen = ~0u);
  void wait_all_parts();
  // Whether every chunk of read `gen` of `slot` has its copy queued and not yet waited for
  // (the IO thread whose part completes a chunk records its copy in pending_ before the part
  // counts done, and the record completes after every part counted done: the stream's lock
  // orders them).
  bool all_chunks_queued(std::uint32_t slot, std::uint32_t gen);
  // Parts a chunk for a record split in parts of `part_bytes`.
  std::uint32_t parts_per_chunk(std::uint64_t part_bytes) const {
    return chunk_bytes_ > part_bytes ? std::uint32_t(chunk_bytes_ / part_bytes) : 1u;
  }
  void release();
  // The mirror's device bytes (null before allocate()).
  unsigned char* mirror_bytes() const { return memory_.as<unsigned char>(); }
  // Copies `size` host bytes to `offset` in the mirror on a copy lane and waits for it.
  void copy_and_wait(const unsigned char* host, std::uint64_t offset, std::uint64_t size);

  std::shared_mutex mu_;
  DeviceArray memory_;                                   // mu_: the mirror's device bytes
  std::unique_ptr<std::atomic<std::uint32_t>[]> tags_;  // mu_ (the array); entries: see above
  std::uint32_t n_slots_ = 0;                            // mu_
  std::uint64_t slot_bytes_ = 0, record_bytes_ = 0;      // mu_
  std::mutex lanes_mu_;
  std::vector<Lane> free_lanes_, all_lanes_;  // lanes_mu_
  // lanes_mu_: each IO thread's part lane, created at its first part copy, kept until the end.
  std::unordered_map<std::thread::id, cudaStream_t> part_lanes_;
  std::mutex pending_mu_;
  std::unordered_map<std::uint32_t, SlotCopies> pending_;  // pending_mu_: by slot
  std::vector<cudaEvent_t> spare_events_, all_events_;  // pending_mu_
  // Counts and times, for STRATA_CUDA_TRACE (relaxed: read when the backend goes).
  std::atomic<std::uint64_t> at_completion_{0}, lazy_{0}, issue_ns_{0}, wait_ns_{0}, chunks_{0};
  bool copy_parts_ = false;         // set before registration, then read only
  std::uint64_t chunk_bytes_ = 0;   // the same
};

}  // namespace strata::cuda
