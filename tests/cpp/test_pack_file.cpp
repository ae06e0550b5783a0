#include <catch2/catch.hpp>

#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <set>

#include "common/errors.h"
#include "pack_builder.h"
#include "pack/checksum.h"
#include "pack/pack_file.h"

using namespace strata;
using namespace strata::test;

namespace {

std::string pack_error_of(const std::string& path) {
  try {
    read_pack_layout(path);
  } catch (const EngineError& e) {
    REQUIRE(e.kind() == ErrorKind::Pack);
    return e.what();
  }
  return "";
}

void rehash_header(const std::string& path) {
  unsigned char h[kHeaderBytes];
  FILE* f = std::fopen(path.c_str(), "rb");
  REQUIRE(std::fread(h, 1, kHeaderBytes, f) == kHeaderBytes);
  std::fclose(f);
  std::uint32_t crc = crc32_bytes(h, 4092);
  poke(path, 4092, &crc, 4);
}

}  // namespace

TEST_CASE("a pack written to the spec parses back to its geometry") {
  TestGeometry g;
  auto path = build_test_pack(g, "parse");
  PackLayout L = read_pack_layout(path);
  CHECK(L.n_layers == g.n_layers);
  CHECK(L.n_experts == g.n_experts);
  CHECK(L.top_k == g.top_k);
  CHECK(L.record_stride % kPage == 0);
  CHECK(L.tensors.size() == 3);
  PackFile f(path, false);
  auto rec = expected_record(g, 1, 3);
  CHECK(f.checksums()[1 * g.n_experts + 3] == crc32c(rec.data(), rec.size()));
  CHECK(f.read_router(2).size() == std::size_t(g.n_experts) * g.hidden);
  std::remove(path.c_str());
}

TEST_CASE("bad packs are rejected naming the file and the field") {
  TestGeometry g;
  SECTION("magic") {
    auto path = build_test_pack(g, "magic");
    poke(path, 0, "NOTAPACK", 8);
    auto msg = pack_error_of(path);
    CHECK(msg.find("bad magic") != std::string::npos);
    CHECK(msg.find(path) != std::string::npos);
    std::remove(path.c_str());
  }
  SECTION("version") {
    auto path = build_test_pack(g, "version");
    std::uint32_t v = 9;
    poke(path, 8, &v, 4);
    CHECK(pack_error_of(path).find("version 9") != std::string::npos);
    std::remove(path.c_str());
  }
  SECTION("version 1 (zlib record checksums): refused, saying how to repack") {
    auto path = build_test_pack(g, "v1");
    std::uint32_t v = 1;
    poke(path, 8, &v, 4);
    rehash_header(path);
    auto msg = pack_error_of(path);
    CHECK(msg.find(path) != std::string::npos);
    CHECK(msg.find("format version 1") != std::string::npos);
    CHECK(msg.find("repack with strata-stream pack/convert") != std::string::npos);
    std::remove(path.c_str());
  }
  SECTION("header crc") {
    auto path = build_test_pack(g, "crc");
    std::uint32_t k = 99;
    poke(path, 24, &k, 4);
    CHECK(pack_error_of(path).find("header_crc") != std::string::npos);
    std::remove(path.c_str());
  }
  SECTION("field out of range, crc fixed up") {
    auto path = build_test_pack(g, "topk");
    std::uint32_t k = 99;
    poke(path, 24, &k, 4);
    rehash_header(path);
    CHECK(pack_error_of(path).find("top_k") != std::string::npos);
    std::remove(path.c_str());
  }
  SECTION("truncated") {
    auto path = build_test_pack(g, "trunc");
    PackLayout L = read_pack_layout(path);
    truncate_to(path, L.file_bytes - 100);
    auto msg = pack_error_of(path);
    CHECK(msg.find("truncated") != std::string::npos);
    CHECK(msg.find("file_bytes") != std::string::npos);
    truncate_to(path, 100);
    CHECK(pack_error_of(path).find("shorter than") != std::string::npos);
    std::remove(path.c_str());
  }
  SECTION("tensor out of order, crc fixed up") {
    auto path = build_test_pack(g, "order");
    std::uint32_t role = 1;
    poke(path, 144 + 32 + 4, &role, 4);
    rehash_header(path);
    auto msg = pack_error_of(path);
    CHECK(msg.find(path) != std::string::npos);
    CHECK(msg.find("tensor table entry 1 field role is 1") != std::string::npos);
    std::remove(path.c_str());
  }
  SECTION("missing file") {
    CHECK(pack_error_of("/nonexistent/x.strpk").find("cannot open") != std::string::npos);
  }
}

// ---- crafted headers: every field validated, valid crc --------------------------------------

namespace {

const std::string kFuzzPath = "/crafted/fuzz.strpk";

// parse_pack_header on a header in memory, with the file size its file_bytes field claims.
std::string parse_error(const std::vector<unsigned char>& h) {
  try {
    parse_pack_header(h.data(), h.size(), kFuzzPath, get_field<std::uint64_t>(h, 128));
  } catch (const EngineError& e) {
    REQUIRE(e.kind() == ErrorKind::Pack);
    return e.what();
  }
  return "";
}

TestGeometry quant_geometry() {
  TestGeometry g;
  g.hidden = 128;
  g.moe_intermediate = 256;
  return g;
}

struct Base {
  TestGeometry g;
  std::uint32_t fmt, group, scale;
};

const Base kBases[] = {
    {TestGeometry{}, 0, 0, 0},       {TestGeometry{}, 1, 0, 0},
    {TestGeometry{}, 2, 0, 0},       {quant_geometry(), 3, 32, 1},
    {quant_geometry(), 3, 64, 0},    {quant_geometry(), 4, 128, 2},
};

}  // namespace

TEST_CASE("headers written to the spec parse for every weight format") {
  for (const Base& b : kBases) {
    auto h = make_header(b.g, b.fmt, b.group, b.scale);
    INFO("format " << b.fmt << " group " << b.group);
    REQUIRE(parse_error(h).empty());
    PackLayout L = parse_pack_header(h.data(), h.size(), kFuzzPath, get_field<std::uint64_t>(h, 128));
    CHECK(L.tensors.size() == (b.fmt >= 3 ? 9u : 3u));
    CHECK(L.record_bytes == get_field<std::uint64_t>(h, 56));
  }
}

TEST_CASE("a tensor whose offset + nbytes wraps around 2^64 is rejected") {
  // With a 256-aligned offset just below 2^64 the end wraps to a small number, so a check of
  // only the last end against record_bytes, or of ends in order, lets it through.
  for (std::uint32_t entry : {1u, 2u}) {
    auto h = make_header(TestGeometry{});
    set_field<std::uint64_t>(h, 144 + 32 * entry + 8, ~std::uint64_t(0) - 255);
    rehash(h);
    auto msg = parse_error(h);
    INFO(msg);
    CHECK(msg.find(kFuzzPath) != std::string::npos);
    CHECK(msg.find("tensor table entry " + std::to_string(entry) + " field offset") !=
          std::string::npos);
  }
}

TEST_CASE("every tensor must lie inside record_bytes, not only the last") {
  auto h = make_header(TestGeometry{});
  // record_bytes and the stride stay consistent (same 16 KiB page), so only the tensor check
  // can see that tensor 0 now ends past the end of the record the checksum covers.
  const std::uint64_t rb = get_field<std::uint64_t>(h, 56);
  set_field<std::uint64_t>(h, 56, rb - 256);
  rehash(h);
  auto msg = parse_error(h);
  INFO(msg);
  CHECK(msg.find("header field record_bytes is " + std::to_string(rb - 256)) != std::string::npos);
  // A record_bytes past the last tensor (inside the same stride) is not canonical either.
  h = make_header(TestGeometry{});
  set_field<std::uint64_t>(h, 56, rb + 256);
  rehash(h);
  CHECK(parse_error(h).find("header field record_bytes") != std::string::npos);
}

TEST_CASE("hidden and moe_intermediate must be multiples of group_size") {
  // The tensor table make_header writes is what truncating division gives (cols / group_size),
  // so every size and offset agrees with it: only the divisibility check can refuse it.
  TestGeometry g = quant_geometry();
  g.hidden = 96;  // a multiple of 32 (whole u32 words of q4), not of 64
  auto h = make_header(g, 3, 64, 0);
  auto msg = parse_error(h);
  INFO(msg);
  CHECK(msg.find(kFuzzPath) != std::string::npos);
  CHECK(msg.find("header field hidden is 96, not a multiple of group_size 64") != std::string::npos);
  g = quant_geometry();
  g.moe_intermediate = 160;
  h = make_header(g, 4, 64, 0);
  CHECK(parse_error(h).find("header field moe_intermediate is 160") != std::string::npos);
}

TEST_CASE("every fixed header field is checked and named") {
  struct Case {
    std::size_t offset, width;
    std::uint64_t value;
    const char* message;
  };
  const Case cases[] = {
      {12, 4, 512, "header field header_bytes is 512"},
      {16, 4, 0, "header field n_layers is 0"},
      {16, 4, kMaxLayers + 1, "header field n_layers is 4097"},
      {20, 4, 0, "header field n_experts is 0"},
      {24, 4, 17, "header field top_k is 17"},
      {28, 4, 0, "header field hidden is 0"},
      {32, 4, 0, "header field moe_intermediate is 0"},
      {36, 4, 3, "header field routing is 3"},
      // routing 2 is valid (external: no routers), so router_bytes must then be 0.
      {36, 4, 2, "header field router_bytes is 16384 but the geometry and format imply 0"},
      {1024, 4, 9, "header field activation is 9"},
      {1036, 4, 4, "header field bias_format is 4"},
      {40, 4, 2, "header field norm_topk_prob is 2"},
      {44, 4, 6, "header field weight_format is 6"},
      {44, 4, 5, "header fields group_size 0 and scale_format 0 must be 32 and 3 (e8m0) for mxfp4"},
      {48, 4, 64, "header fields group_size 64 and scale_format 0 must be 0"},
      {52, 4, 4, "header field scale_format is 4"},
      {52, 4, 1, "header fields group_size 0 and scale_format 1 must be 0"},
      {56, 8, 1, "header field record_bytes is 1 "},
      {64, 8, 4096, "header field record_stride is 4096"},
      {72, 8, 0, "header field meta_offset is 0"},
      {80, 8, ~std::uint64_t(0), "header field meta_bytes: the layout"},
      {88, 8, 8192, "header field router_offset is 8192"},
      {96, 8, 4, "header field router_bytes is 4 "},
      {104, 8, 0, "header field checksum_offset is 0"},
      {112, 8, 8, "header field checksum_bytes is 8 "},
      {120, 8, 1ull << 40, "header field records_offset is 1099511627776"},
      {136, 4, 9, "header field n_tensors is 9"},
  };
  for (const Case& c : cases) {
    auto h = make_header(TestGeometry{});
    if (c.width == 4)
      set_field<std::uint32_t>(h, c.offset, std::uint32_t(c.value));
    else
      set_field<std::uint64_t>(h, c.offset, c.value);
    rehash(h);
    auto msg = parse_error(h);
    INFO("offset " << c.offset << ": " << msg);
    CHECK(msg.find(kFuzzPath) != std::string::npos);
    CHECK(msg.find(c.message) != std::string::npos);
  }
  // mxfp4: its own layout (weight and u8 scales per matrix) parses; e8m0 scales are its alone.
  {
    TestGeometry g;
    g.moe_intermediate = 64;  // whole groups of 32
    auto mx = make_header(g, 5, 32, 3);
    const PackLayout L = parse_pack_header(mx.data(), mx.size(), kFuzzPath,
                                           get_field<std::uint64_t>(mx, 128));
    CHECK(L.weight_format == WeightFormat::Mxfp4);
    REQUIRE(L.tensors.size() == 6);
    CHECK(L.tensors[1].role == 1);
    CHECK(L.tensors[1].nbytes == std::uint64_t(L.moe_intermediate) * (L.hidden / 32));
    auto q4 = make_header(g, 3, 32, 3);
    CHECK(parse_error(q4).find("scale_format 3 (e8m0) is for mxfp4 only") != std::string::npos);
    auto g64 = make_header(g, 5, 64, 3);
    CHECK(parse_error(g64).find("must be 32 and 3 (e8m0) for mxfp4") != std::string::npos);
  }
  // file_bytes is checked against the geometry, then against the file.
  auto h = make_header(TestGeometry{});
  const std::uint64_t fb = get_field<std::uint64_t>(h, 128);
  set_field<std::uint64_t>(h, 128, fb + kPage);
  rehash(h);
  CHECK(parse_error(h).find("header field file_bytes is " + std::to_string(fb + kPage)) !=
        std::string::npos);
  h = make_header(TestGeometry{});
  try {
    parse_pack_header(h.data(), h.size(), kFuzzPath, fb + 1);
    FAIL("a file one byte too long was accepted");
  } catch (const EngineError& e) {
    CHECK(std::string(e.what()).find("header field file_bytes says") != std::string::npos);
  }
}

TEST_CASE("a geometry whose layout overflows 64 bits is rejected, not wrapped") {
  TestGeometry g;
  g.hidden = g.moe_intermediate = 0xFFFFFFFFu;  // 3 * (2^32)^2 * 4 bytes per record
  auto h = make_header(TestGeometry{});
  set_field<std::uint32_t>(h, 28, g.hidden);
  set_field<std::uint32_t>(h, 32, g.moe_intermediate);
  rehash(h);
  auto msg = parse_error(h);
  INFO(msg);
  CHECK(msg.find("overflows 64 bits") != std::string::npos);
}

// Header fuzzing: fields changed to random and boundary values, crc recomputed, parsed many
// times. Runs under ASan/UBSan in CI. Every outcome must be a Pack error naming the file, or a
// layout that is exactly the canonical one for the geometry it states (nothing looser).
TEST_CASE("fuzzed headers with valid crcs: a named Pack error or the canonical layout") {
  struct Field {
    std::size_t offset, width;
  };
  std::vector<Field> fields;
  for (std::size_t off = 8; off < 56; off += 4) fields.push_back({off, 4});
  for (std::size_t off = 56; off < 136; off += 8) fields.push_back({off, 8});
  fields.push_back({136, 4});
  fields.push_back({140, 4});
  fields.push_back({4088, 4});
  for (std::size_t i = 0; i < 9; ++i) {
    const std::size_t t = 144 + 32 * i;
    for (Field f : {Field{t, 4}, Field{t + 4, 4}, Field{t + 8, 8}, Field{t + 16, 8},
                    Field{t + 24, 4}, Field{t + 28, 4}})
      fields.push_back(f);
  }
  std::mt19937_64 rng(20261130);
  auto pick = [&](std::uint64_t orig, std::size_t width) -> std::uint64_t {
    const std::uint64_t max = width == 8 ? ~std::uint64_t(0) : 0xFFFFFFFFull;
    switch (rng() % 16) {
      case 0: return 0;
      case 1: return 1;
      case 2: return max;
      case 3: return max - 255;  // aligned, wraps any positive size added to it
      case 4: return orig + 1;
      case 5: return orig - 1;
      case 6: return orig * 2;
      case 7: return orig / 2;
      case 8: return (max - orig + 1) & max;  // -orig: cancels orig in a wrapping sum
      case 9: return 1ull << (rng() % (8 * width));
      case 10: return orig + kPage;
      case 11: return orig + (std::uint64_t(1) << 32);
      case 12: return rng() % 4096;
      case 13: return orig ^ (std::uint64_t(1) << (rng() % (8 * width)));
      default: return rng() & max;
    }
  };
  std::uint64_t accepted = 0, rejected = 0;
  for (int iter = 0; iter < 40000; ++iter) {
    const Base& b = kBases[rng() % std::size(kBases)];
    auto h = make_header(b.g, b.fmt, b.group, b.scale, 1 + rng() % 3000);
    const int n_changes = 1 + int(rng() % 3);
    for (int c = 0; c < n_changes; ++c) {
      const Field f = fields[rng() % fields.size()];
      if (f.width == 4)
        set_field<std::uint32_t>(h, f.offset, std::uint32_t(pick(get_field<std::uint32_t>(h, f.offset), 4)));
      else
        set_field<std::uint64_t>(h, f.offset, pick(get_field<std::uint64_t>(h, f.offset), 8));
    }
    if (rng() % 64 == 0) h[rng() % 8] ^= 1;  // magic
    if (rng() % 64 != 0) rehash(h);           // mostly a valid crc, sometimes not
    const std::uint64_t claimed = get_field<std::uint64_t>(h, 128);
    const std::uint64_t actual = rng() % 8 == 0 ? rng() : claimed;
    try {
      PackLayout L = parse_pack_header(h.data(), h.size(), kFuzzPath, actual);
      ++accepted;
      // Accepted: the header must be the canonical one for what it states.
      TestGeometry g;
      g.n_layers = L.n_layers;
      g.n_experts = L.n_experts;
      g.top_k = L.top_k;
      g.hidden = L.hidden;
      g.moe_intermediate = L.moe_intermediate;
      auto want = make_header(g, std::uint32_t(L.weight_format), L.group_size, L.scale_format,
                              L.meta_bytes);
      set_field<std::uint32_t>(want, 36, std::uint32_t(L.routing));
      set_field<std::uint32_t>(want, 40, L.norm_topk_prob ? 1 : 0);
      const std::size_t table_end = 144 + 32 * L.tensors.size();
      INFO("iteration " << iter);
      REQUIRE(std::memcmp(h.data(), want.data(), 140) == 0);
      REQUIRE(std::memcmp(h.data() + 144, want.data() + 144, table_end - 144) == 0);
      REQUIRE(actual == L.file_bytes);
      for (const TensorEntry& t : L.tensors) {
        REQUIRE(t.offset <= L.record_bytes);
        REQUIRE(t.nbytes <= L.record_bytes - t.offset);
      }
    } catch (const EngineError& e) {
      ++rejected;
      const std::string msg = e.what();
      INFO("iteration " << iter << ": " << msg);
      REQUIRE(e.kind() == ErrorKind::Pack);
      REQUIRE(msg.rfind("pack " + kFuzzPath + ": ", 0) == 0);
      const bool named = msg.find("field") != std::string::npos ||
                         msg.find("bad magic") != std::string::npos ||
                         msg.find("version") != std::string::npos ||
                         msg.find("header_crc") != std::string::npos;
      REQUIRE(named);
    }
  }
  CHECK(rejected > 0);
  CHECK(accepted > 0);  // some changes are harmless (meta_crc, router_crc, routing, ...)
}

TEST_CASE("the test pack holds exactly expected_record, and no two records are equal") {
  TestGeometry g;
  auto path = build_test_pack(g, "records");
  PackFile f(path, false);
  const PackLayout& L = f.layout();
  std::set<std::vector<unsigned char>> seen;
  std::vector<unsigned char> buf(L.record_bytes);
  for (std::uint32_t l = 0; l < g.n_layers; ++l)
    for (std::uint32_t e = 0; e < g.n_experts; ++e) {
      std::size_t got = 0;
      REQUIRE(f.read_fully(L.record_offset(l * g.n_experts + e), buf.data(), buf.size(), &got) == 0);
      auto want = expected_record(g, l, e);
      REQUIRE(want == expected_record(g, l, e));  // deterministic
      REQUIRE(buf == want);
      CHECK(f.checksums()[l * g.n_experts + e] == crc32c(want.data(), want.size()));
      seen.insert(want);
    }
  CHECK(seen.size() == std::size_t(g.n_layers) * g.n_experts);
  std::remove(path.c_str());
}
