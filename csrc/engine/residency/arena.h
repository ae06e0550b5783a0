// The arena: one page-aligned anonymous mapping of n_slots x record_stride bytes. Slots start on
// 16 KiB boundaries, so each is a valid O_DIRECT destination and (on macOS) the whole arena can be
// wrapped by one no-copy MTLBuffer.
#pragma once

#include <cstddef>
#include <cstdint>

namespace strata {

class Arena {
 public:
  Arena(std::uint32_t n_slots, std::uint64_t slot_bytes);
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  unsigned char* slot(std::uint32_t s) const { return base_ + std::uint64_t(s) * slot_bytes_; }
  unsigned char* data() const { return base_; }
  std::uint64_t bytes() const { return std::uint64_t(n_slots_) * slot_bytes_; }
  std::uint32_t n_slots() const { return n_slots_; }
  std::uint64_t slot_bytes() const { return slot_bytes_; }

 private:
  std::uint32_t n_slots_;
  std::uint64_t slot_bytes_;
  void* map_ = nullptr;  // what mmap returned
  std::size_t map_bytes_ = 0;
  unsigned char* base_ = nullptr;  // 16 KiB aligned inside map_
};

}  // namespace strata
