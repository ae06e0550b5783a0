// Writes small f32 packs for the C++ tests, independently of the Python writer: two writers
// agreeing with one reader is a check of docs/pack-format.md itself.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace strata::test {

struct TestGeometry {
  std::uint32_t n_layers = 4, n_experts = 16, top_k = 2, hidden = 64, moe_intermediate = 48;
};

// Returns the path of a fresh pack under a temporary directory. Record bytes are a
// deterministic function of (layer, expert), so any slot can be checked against the file.
std::string build_test_pack(const TestGeometry& g, const std::string& name);

// The record payload (layer, expert) as written.
std::vector<unsigned char> expected_record(const TestGeometry& g, std::uint32_t layer,
                                           std::uint32_t expert);

// Overwrites bytes of the file (to corrupt headers in tests).
void poke(const std::string& path, std::uint64_t offset, const void* data, std::size_t n);
void truncate_to(const std::string& path, std::uint64_t size);

}  // namespace strata::test
