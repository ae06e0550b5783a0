// Writes small f32 packs for the C++ tests, independently of the Python writer: two writers
// agreeing with one reader is a check of docs/pack-format.md itself.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace strata::test {

struct TestGeometry {
  std::uint32_t n_layers = 4, n_experts = 16, top_k = 2, hidden = 64, moe_intermediate = 48;
};

// The 4096 header bytes docs/pack-format.md prescribes for this geometry, weight format
// (0 f32 .. 4 q8, 5 mxfp4), group size and scale format (quantized formats only) and metadata length,
// computed here from the spec rather than by the engine; header_crc set, router_crc and
// meta_crc 0 (the caller sets them, then recomputes the header crc).
std::vector<unsigned char> make_header(const TestGeometry& g, std::uint32_t weight_format = 0,
                                       std::uint32_t group_size = 0,
                                       std::uint32_t scale_format = 0,
                                       std::uint64_t meta_bytes = 64);
// Recomputes the header crc after a test changed a field.
void rehash(std::vector<unsigned char>& header);
// Field readers/writers for a header in memory (little-endian, as the format).
template <class T>
T get_field(const std::vector<unsigned char>& h, std::size_t off) {
  T v;
  std::memcpy(&v, h.data() + off, sizeof v);
  return v;
}
template <class T>
void set_field(std::vector<unsigned char>& h, std::size_t off, T v) {
  std::memcpy(h.data() + off, &v, sizeof v);
}

// Returns the path of a fresh pack under a temporary directory. Record bytes are a
// deterministic function of (layer, expert), so any slot can be checked against the file.
// weight_format / group_size / scale_format as make_header: f32 by default; a quantized pack's
// records are a stream of small bfloat16 numbers (every 16 bits), so whatever its tensor
// layout, its scales and biases are finite and its packed words arbitrary codes.
std::string build_test_pack(const TestGeometry& g, const std::string& name,
                            std::uint32_t weight_format = 0, std::uint32_t group_size = 0,
                            std::uint32_t scale_format = 0);

// The record payload (layer, expert) as written: a distinct xorshift stream seeded by
// (layer, expert), so a slot holding another record never matches (tests/cpp/test_pack_file.cpp
// checks that the file holds exactly these bytes and that no two records are equal).
std::vector<unsigned char> expected_record(const TestGeometry& g, std::uint32_t layer,
                                           std::uint32_t expert);

// Overwrites bytes of the file (to corrupt headers in tests).
void poke(const std::string& path, std::uint64_t offset, const void* data, std::size_t n);
void truncate_to(const std::string& path, std::uint64_t size);

}  // namespace strata::test
