// CRC32C (Castagnoli, reflected polynomial 0x82F63B78): the record checksum of pack format
// version 2 (docs/pack-format.md). Chosen over zlib's CRC-32 because x86-64 (SSE4.2 `crc32`) and
// ARMv8 (`crc32c*`) compute it in hardware at several GB/s per core, so verifying every expert
// read costs little next to the read itself. The Python writer, reader and `strata-stream verify`
// call the same code through `_core.crc32c`.
#pragma once

#include <cstddef>
#include <cstdint>

namespace strata {

// CRC32C of `n` bytes, continuing from `seed` (the CRC of the bytes before): with seed 0 it is
// the plain CRC, and crc32c(b, crc32c(a)) == crc32c(a + b), as with zlib's crc32. Uses the
// hardware instructions when the CPU has them, else a table implementation.
std::uint32_t crc32c(const void* data, std::size_t n, std::uint32_t seed = 0);

// The CRC32C of a + b from crc32c(a), crc32c(b) and b's length, in O(log len_b) carry-less
// multiplications modulo the polynomial: so several threads can checksum the parts of one
// record as each part lands, and the record's check after its last part costs only that
// part's CRC and the combines.
std::uint32_t crc32c_combine(std::uint32_t crc_a, std::uint32_t crc_b, std::uint64_t len_b);

// The table implementation alone (slicing by 8), for tests and as the fallback.
std::uint32_t crc32c_portable(const void* data, std::size_t n, std::uint32_t seed = 0);

// True when crc32c() runs on CRC instructions on this machine.
bool crc32c_hardware();

// "avx512-vpclmulqdq" (folding for buffers of 1 KiB and more, sse4.2 below), "sse4.2",
// "armv8-crc" or "table": what crc32c() uses here (for benchmark reports).
const char* crc32c_impl();

}  // namespace strata
