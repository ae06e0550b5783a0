// The fair raw reference for benchmarks/io_bandwidth.py --page-cache: plain threaded preads of
// the same records, split into the same parts as ExpertStream splits them, into a destination
// as large as the engine's arena (pre-faulted, as the arena is), with no Python in the loop.
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
// destination. direct: O_DIRECT (else buffered, the page cache as the device).
RawReadResult raw_read_records(const std::string& path, std::uint64_t first, std::uint64_t count,
                               std::uint64_t part_bytes, unsigned threads,
                               std::uint64_t dest_bytes, bool direct);

}  // namespace strata
