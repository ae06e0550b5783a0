// A hook at IO completion: what a backend must do with a record's bytes before the stream may
// publish the record (docs/architecture.md, section 4; docs/cuda.md, "Publication implies device
// bytes"). The CUDA backend copies each record into its device mirror here, so that a published
// slot's bytes are on the GPU before the device can find the slot.
//
// Contract (ExpertStream::add_observer):
// - Called on an IO thread, without the stream's lock, once per record whose every part was read
//   (and passed its CRC32C when verify_reads is on), for urgent and speculative reads alike,
//   before the slot can be published (I1: nothing is published before every observer returned).
//   While it runs the record's last part still counts as in flight, so nothing recycles the slot
//   or reuses its bytes under it (I7).
// - Several IO threads may call it at once, for different slots.
// - It may block (a device copy and its completion); it must not call back into the stream.
// - A throw (std::exception) fails the record with that message as its cause: the slot is not
//   published, an urgent read raises ExpertReadError naming the cause, a speculative one is
//   dropped and counted, and the stream stays usable.
// - on_part_read (optional): called the same way for each part of the record as that part's
//   pread (and its CRC32C) finished, on the thread that read it, while the part counts as in
//   flight, before the record is checked; parts of one read share `gen`. An observer that
//   registers while a record is being read may see only some of its parts, so it must not take
//   parts seen for a whole record: on_record_complete says how many parts the record has.
//   A throw fails the record as above.
#pragma once

#include <cstdint>

namespace strata {

struct CompletedRecord {
  std::uint32_t slot = 0;               // the arena slot that holds it
  std::uint32_t key = 0;                // layer * n_experts + expert
  const unsigned char* bytes = nullptr;  // the slot's bytes in the host arena
  std::uint64_t size = 0;               // the record's bytes (PackLayout::record_bytes)
  std::uint32_t gen = 0;                // the slot's read generation (ReadPart::gen)
  std::uint32_t parts = 0;              // parts holding record bytes, each seen by on_part_read
};

struct ReadPart {
  std::uint32_t slot = 0, key = 0;
  std::uint32_t gen = 0;                // the same for every part of one read of the slot
  std::uint32_t part = 0;               // 0 .. CompletedRecord::parts - 1
  std::uint64_t offset = 0;             // of the part within the record
  const unsigned char* bytes = nullptr;  // the part's bytes in the host arena
  std::uint64_t size = 0;               // its record bytes (the last may be short)
  // The record's split, the same for every part of a stream: part k starts at k * part_bytes,
  // and `parts` of them hold record bytes (CompletedRecord::parts). An observer that copies
  // several landed parts at once (the CUDA mirror's copy chunks) finds its ranges from these.
  std::uint32_t parts = 0;
  std::uint64_t part_bytes = 0;
};

class RecordObserver {
 public:
  virtual ~RecordObserver() = default;
  virtual void on_part_read(const ReadPart& /*part*/) {}
  virtual void on_record_complete(const CompletedRecord& record) = 0;
};

// What add_observer returns and remove_observer takes.
enum class ObserverId : std::uint32_t {};

}  // namespace strata
