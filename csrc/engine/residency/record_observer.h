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
#pragma once

#include <cstdint>

namespace strata {

struct CompletedRecord {
  std::uint32_t slot = 0;               // the arena slot that holds it
  std::uint32_t key = 0;                // layer * n_experts + expert
  const unsigned char* bytes = nullptr;  // the slot's bytes in the host arena
  std::uint64_t size = 0;               // the record's bytes (PackLayout::record_bytes)
};

class RecordObserver {
 public:
  virtual ~RecordObserver() = default;
  virtual void on_record_complete(const CompletedRecord& record) = 0;
};

// What add_observer returns and remove_observer takes.
enum class ObserverId : std::uint32_t {};

}  // namespace strata
