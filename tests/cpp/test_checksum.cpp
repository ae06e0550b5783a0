#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "pack/checksum.h"

using namespace strata;

namespace {

std::vector<unsigned char> pseudo_random(std::size_t n, std::uint32_t seed) {
  std::vector<unsigned char> v(n);
  std::uint32_t x = seed * 2654435761u + 1;
  for (auto& b : v) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    b = static_cast<unsigned char>(x);
  }
  return v;
}

}  // namespace

TEST_CASE("crc32c matches the published check values") {
  const std::string check = "123456789";
  CHECK(crc32c(check.data(), check.size()) == 0xE3069283u);
  CHECK(crc32c_portable(check.data(), check.size()) == 0xE3069283u);
  CHECK(crc32c(nullptr, 0) == 0u);
  // RFC 3720 (iSCSI) B.4: 32 bytes of zeros, of 0xFF, and an ascending run.
  unsigned char zeros[32] = {}, ones[32], inc[32];
  std::memset(ones, 0xFF, sizeof ones);
  for (int i = 0; i < 32; ++i) inc[i] = static_cast<unsigned char>(i);
  CHECK(crc32c(zeros, 32) == 0x8A9136AAu);
  CHECK(crc32c(ones, 32) == 0x62A8AB43u);
  CHECK(crc32c(inc, 32) == 0x46DD794Eu);
}

TEST_CASE("hardware and table crc32c agree at every length, alignment and seed") {
  INFO("implementation: " << crc32c_impl());
  // Lengths around the interleaved loop's block edges (3 x 256, 3 x 8192), the folding loop's
  // (from 1 KiB, 256 bytes a step, with tails of every kind) and beyond.
  const std::size_t lengths[] = {0,     1,     7,     8,     9,      255,    767,    768,
                                 769,   1023,  1024,  1025,  1031,   1279,   1280,   1281,
                                 1535,  2047,  3000,  4351,  24575,  24576,  24577,  24583,
                                 65553, 100000, 1 << 20};
  auto buf = pseudo_random((1 << 20) + 16, 7);
  for (std::size_t n : lengths)
    for (std::size_t align = 0; align < 8; align += 3)
      for (std::uint32_t seed : {0u, 0xDEADBEEFu}) {
        const unsigned char* p = buf.data() + align;
        CAPTURE(n, align, seed);
        REQUIRE(crc32c(p, n, seed) == crc32c_portable(p, n, seed));
      }
}

TEST_CASE("crc32c continues from a seed like zlib's crc32") {
  auto buf = pseudo_random(50000, 3);
  const std::uint32_t whole = crc32c(buf.data(), buf.size());
  for (std::size_t cut : {std::size_t(0), std::size_t(1), std::size_t(8191), std::size_t(30000)}) {
    CAPTURE(cut);
    std::uint32_t first = crc32c(buf.data(), cut);
    CHECK(crc32c(buf.data() + cut, buf.size() - cut, first) == whole);
  }
}

TEST_CASE("crc32c sees a single flipped bit anywhere in a record") {
  auto buf = pseudo_random(3 * 8192 * 2 + 100, 11);
  const std::uint32_t good = crc32c(buf.data(), buf.size());
  for (std::size_t at : {std::size_t(0), std::size_t(8191), std::size_t(8192 * 3 + 5), buf.size() - 1}) {
    buf[at] ^= 0x10;
    CHECK(crc32c(buf.data(), buf.size()) != good);
    buf[at] ^= 0x10;
  }
}

TEST_CASE("crc32c_combine of two parts' CRCs is the CRC of the whole, at every split") {
  std::vector<unsigned char> buf = pseudo_random(3 * 1024 * 1024 + 37, 7);
  const std::uint32_t whole = crc32c(buf.data(), buf.size());
  for (std::size_t split : {std::size_t(0), std::size_t(1), std::size_t(7), std::size_t(4096),
                            std::size_t(1) << 20, buf.size() - 1, buf.size()}) {
    const std::uint32_t a = crc32c(buf.data(), split);
    const std::uint32_t b = crc32c(buf.data() + split, buf.size() - split);
    REQUIRE(crc32c_combine(a, b, buf.size() - split) == whole);
  }
  // Many parts folded in order, as the IO threads' parts of one record are.
  const std::size_t part = 1 << 20;
  std::uint32_t folded = 0;
  for (std::size_t off = 0; off < buf.size(); off += part) {
    const std::size_t n = std::min(part, buf.size() - off);
    const std::uint32_t c = crc32c(buf.data() + off, n);
    folded = off == 0 ? c : crc32c_combine(folded, c, n);
  }
  REQUIRE(folded == whole);
  // A flipped bit in a later part changes the folded CRC.
  buf[part + 12345] ^= 0x10;
  const std::uint32_t b2 = crc32c(buf.data() + part, buf.size() - part);
  REQUIRE(crc32c_combine(crc32c(buf.data(), part), b2, buf.size() - part) != whole);
}
