// The fair raw reference for benchmarks/io_bandwidth.py --page-cache and benchmarks/io_path.py:
// plain threaded preads of the same records, split into the same parts as ExpertStream splits
// them, into a destination as large as the engine's arena (pre-faulted, as the arena is) or
// into small per-thread buffers, with no Python in the loop.
#pragma once

#include <cstdint>
#include <string>

namespace strata {

struct RawReadResult {
  double seconds;
  std::uint64_t bytes;
};

// Reads records [first, first + count) of the pack at `path` (record r at records_offset +
// r * stride, read_span bytes of it, parts of part_bytes), `threads` threads taking the next part
// from a shared counter. Record r lands at (r % (dest_bytes / stride)) * stride of the
// destination; with dest_bytes 0 each thread reads into two part-sized buffers of its own in
// turn instead (small, reused, warm in the cache). direct: O_DIRECT (else buffered, the page
// cache as the device). crc: each part's CRC32C after its pread, by the thread that read it, as
// the engine's verify_reads does.
RawReadResult raw_read_records(const std::string& path, std::uint64_t first, std::uint64_t count,
                               std::uint64_t part_bytes, unsigned threads,
                               std::uint64_t dest_bytes, bool direct, bool crc = false);

}  // namespace strata
