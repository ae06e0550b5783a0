#include "residency/arena.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <new>
#include <string>

#include "common/errors.h"
#include "pack/pack_file.h"

namespace strata {

Arena::Arena(std::uint32_t n_slots, std::uint64_t slot_bytes)
    : n_slots_(n_slots), slot_bytes_(slot_bytes) {
  // mmap gives 4 KiB pages on Linux; over-allocate one 16 KiB page and align inside.
  map_bytes_ = std::size_t(bytes() + kPage);
  int flags = MAP_PRIVATE | MAP_ANONYMOUS;
#ifdef MAP_POPULATE
  // Commit the budget now: otherwise IO threads take first-touch faults (the kernel zeroing
  // 2.6 MB per new Qwen3 slot) in the middle of turns, stealing the host's core at handshakes.
  flags |= MAP_POPULATE;
#endif
  map_ = ::mmap(nullptr, map_bytes_, PROT_READ | PROT_WRITE, flags, -1, 0);
  if (map_ == MAP_FAILED) {
    map_ = nullptr;
    throw EngineError(ErrorKind::Config, "cannot map an arena of " + std::to_string(bytes()) +
                                             " bytes: " + std::strerror(errno));
  }
  auto addr = reinterpret_cast<std::uintptr_t>(map_);
  base_ = reinterpret_cast<unsigned char*>((addr + kPage - 1) / kPage * kPage);
}

Arena::~Arena() {
  if (map_) ::munmap(map_, map_bytes_);
}

}  // namespace strata
