#include "raw_read_bench.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <vector>

#include "common/timing.h"
#include "pack/checksum.h"
#include "pack/pack_file.h"

namespace strata {

RawReadResult raw_read_records(const std::string& path, std::uint64_t first, std::uint64_t count,
                               std::uint64_t part_bytes, unsigned threads,
                               std::uint64_t dest_bytes, bool direct, bool crc) {
  const PackLayout L = read_pack_layout(path);
  if (first + count > L.n_keys()) throw std::out_of_range("records beyond the pack");
  if (threads == 0 || part_bytes == 0 || part_bytes % kDirectAlign)
    throw std::invalid_argument("threads > 0 and part_bytes a multiple of 4096 are needed");
  const std::uint64_t stride = L.record_stride;
  // dest_bytes 0: each thread reads into its own kBuffers part-sized buffers, in turn (small and
  // reused, so they stay in the cache: the native CUDA reference's pinned staging).
  constexpr std::uint64_t kBuffers = 2;
  const bool staging = dest_bytes == 0;
  const std::uint64_t slots = staging ? 0 : dest_bytes / stride;
  if (!staging && slots == 0) throw std::invalid_argument("destination smaller than one record");
  // The engine's split: the record's payload rounded up to 4096, in parts of part_bytes.
  const std::uint64_t span = (L.record_bytes + kDirectAlign - 1) / kDirectAlign * kDirectAlign;
  const std::uint64_t parts = (span + part_bytes - 1) / part_bytes;

  int flags = O_RDONLY | O_CLOEXEC;
#ifdef O_DIRECT
  if (direct) flags |= O_DIRECT;
#endif
  int fd = ::open(path.c_str(), flags);
  if (fd < 0) throw std::runtime_error("cannot open " + path + ": " + std::strerror(errno));
  // Like the arena: anonymous, 16 KiB aligned, committed before the clock starts.
  const std::size_t map_bytes =
      std::size_t(staging ? threads * kBuffers * part_bytes + kPage : slots * stride + kPage);
  void* map = ::mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  if (map == MAP_FAILED) {
    ::close(fd);
    throw std::runtime_error("cannot map the destination");
  }
  auto* base = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<std::uintptr_t>(map) + kPage - 1) / kPage * kPage);

  std::atomic<std::uint64_t> next{0}, bytes{0};
  std::atomic<std::uint32_t> sink{0};  // the CRCs, so that none is optimised away
  std::atomic<int> error{0};
  const std::uint64_t jobs = count * parts;
  auto worker = [&](unsigned t) {
    std::uint64_t mine = 0, turn = 0;
    std::uint32_t crcs = 0;
    for (std::uint64_t j; (j = next.fetch_add(1, std::memory_order_relaxed)) < jobs;) {
      const std::uint64_t r = first + j / parts, p = j % parts;
      const std::uint64_t rel = p * part_bytes, len = std::min(part_bytes, span - rel);
      unsigned char* dst = staging ? base + (t * kBuffers + turn++ % kBuffers) * part_bytes
                                   : base + (r % slots) * stride + rel;
      const std::uint64_t off = L.record_offset(std::uint32_t(r)) + rel;
      std::uint64_t done = 0;
      while (done < len) {
        ssize_t n = ::pread(fd, dst + done, len - done, off_t(off + done));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
          error.store(n < 0 ? errno : -1);
          return;
        }
        done += std::uint64_t(n);
      }
      // The engine's verify_reads: the part's CRC32C by the thread that read it.
      if (crc && rel < L.record_bytes)
        crcs ^= crc32c(dst, std::size_t(std::min(len, L.record_bytes - rel)));
      mine += done;
    }
    bytes.fetch_add(mine);
    sink.fetch_xor(crcs);
  };
  auto t0 = Clock::now();
  std::vector<std::thread> pool;
  for (unsigned i = 0; i < threads; ++i) pool.emplace_back(worker, i);
  for (auto& t : pool) t.join();
  const double seconds = double(ns_since(t0)) * 1e-9;
  ::munmap(map, map_bytes);
  ::close(fd);
  if (error.load() != 0) throw std::runtime_error("raw read failed: " + std::to_string(error.load()));
  return RawReadResult{seconds, bytes.load()};
}

}  // namespace strata
