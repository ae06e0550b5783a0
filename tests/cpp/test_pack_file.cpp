#include <catch2/catch.hpp>

#include <cstdio>
#include <cstring>

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
  SECTION("missing file") {
    CHECK(pack_error_of("/nonexistent/x.strpk").find("cannot open") != std::string::npos);
  }
}
