#include "pack_builder.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "pack/checksum.h"
#include "pack/pack_file.h"

namespace strata::test {
namespace {

template <class T>
void put(std::vector<unsigned char>& h, std::size_t off, T v) {
  std::memcpy(h.data() + off, &v, sizeof v);
}

std::uint64_t up(std::uint64_t v, std::uint64_t a) { return (v + a - 1) / a * a; }

std::string temp_dir() {
  const char* t = std::getenv("TMPDIR");
  return t && *t ? t : "/tmp";
}

}  // namespace

std::vector<unsigned char> expected_record(const TestGeometry& g, std::uint32_t layer,
                                           std::uint32_t expert) {
  const std::uint64_t mat = std::uint64_t(g.hidden) * g.moe_intermediate * 4;
  const std::uint64_t off1 = up(mat, 256), off2 = off1 + up(mat, 256);
  std::vector<unsigned char> r(off2 + mat, 0);
  std::uint32_t x = 0x9E3779B9u ^ (layer * 7919u + expert * 104729u + 1u);
  for (std::uint64_t base : {std::uint64_t(0), off1, off2})
    for (std::uint64_t i = 0; i < mat; i += 4) {
      x ^= x << 13;
      x ^= x >> 17;
      x ^= x << 5;
      float f = float(int(x % 2001) - 1000) / 1000.0f;
      std::memcpy(r.data() + base + i, &f, 4);
    }
  return r;
}

std::vector<unsigned char> make_header(const TestGeometry& g, std::uint32_t fmt,
                                       std::uint32_t group_size, std::uint32_t scale_format,
                                       std::uint64_t meta_bytes) {
  const bool quant = fmt >= 3;
  const std::uint64_t elem = fmt == 0 ? 4 : 2;
  const std::uint64_t scale_elem = scale_format == 0 ? 4 : scale_format == 3 ? 1 : 2;
  const std::uint64_t keys = std::uint64_t(g.n_layers) * g.n_experts;
  std::vector<unsigned char> h(kHeaderBytes, 0);
  // Tensor table first: record_bytes is the end of its last tensor.
  std::uint32_t n = 0;
  std::uint64_t at = 0;
  auto tensor = [&](std::uint32_t matrix, std::uint32_t role, std::uint32_t rows,
                    std::uint32_t cols, std::uint64_t eb) {
    at = up(at, 256);
    std::size_t t = 144 + 32 * n++;
    put<std::uint32_t>(h, t, matrix);
    put<std::uint32_t>(h, t + 4, role);
    put<std::uint64_t>(h, t + 8, at);
    put<std::uint64_t>(h, t + 16, std::uint64_t(rows) * cols * eb);
    put<std::uint32_t>(h, t + 24, rows);
    put<std::uint32_t>(h, t + 28, cols);
    at += std::uint64_t(rows) * cols * eb;
  };
  for (std::uint32_t m = 0; m < 3; ++m) {
    std::uint32_t rows = m == 2 ? g.hidden : g.moe_intermediate;
    std::uint32_t cols = m == 2 ? g.moe_intermediate : g.hidden;
    if (!quant) {
      tensor(m, 0, rows, cols, elem);
    } else {
      tensor(m, 0, rows, cols * (fmt == 4 ? 8 : 4) / 32, 4);
      tensor(m, 1, rows, cols / group_size, scale_elem);
      if (fmt != 5) tensor(m, 2, rows, cols / group_size, scale_elem);  // mxfp4: no biases
    }
  }
  const std::uint64_t record_bytes = at;
  const std::uint64_t stride = up(record_bytes, kPage);
  const std::uint64_t router_offset = up(kHeaderBytes + meta_bytes, kPage);
  const std::uint64_t router_bytes = keys * g.hidden * 4;
  const std::uint64_t checksum_offset = up(router_offset + router_bytes, kPage);
  const std::uint64_t records_offset = up(checksum_offset + keys * 4, kPage);
  std::memcpy(h.data(), "STRATAPK", 8);
  put<std::uint32_t>(h, 8, kPackVersion);
  put<std::uint32_t>(h, 12, kHeaderBytes);
  put<std::uint32_t>(h, 16, g.n_layers);
  put<std::uint32_t>(h, 20, g.n_experts);
  put<std::uint32_t>(h, 24, g.top_k);
  put<std::uint32_t>(h, 28, g.hidden);
  put<std::uint32_t>(h, 32, g.moe_intermediate);
  put<std::uint32_t>(h, 36, 0);  // softmax_topk
  put<std::uint32_t>(h, 40, 1);
  put<std::uint32_t>(h, 44, fmt);
  put<std::uint32_t>(h, 48, quant ? group_size : 0);
  put<std::uint32_t>(h, 52, quant ? scale_format : 0);
  put<std::uint64_t>(h, 56, record_bytes);
  put<std::uint64_t>(h, 64, stride);
  put<std::uint64_t>(h, 72, kHeaderBytes);
  put<std::uint64_t>(h, 80, meta_bytes);
  put<std::uint64_t>(h, 88, router_offset);
  put<std::uint64_t>(h, 96, router_bytes);
  put<std::uint64_t>(h, 104, checksum_offset);
  put<std::uint64_t>(h, 112, keys * 4);
  put<std::uint64_t>(h, 120, records_offset);
  put<std::uint64_t>(h, 128, records_offset + keys * stride);
  put<std::uint32_t>(h, 136, n);
  rehash(h);
  return h;
}

void rehash(std::vector<unsigned char>& h) { put<std::uint32_t>(h, 4092, header_crc(h.data())); }

namespace {

// Small bfloat16 numbers, +-[2^-7, 2^-1), one every 16 bits.
std::vector<unsigned char> quantized_record(std::uint64_t bytes, std::uint32_t layer,
                                            std::uint32_t expert) {
  std::vector<unsigned char> r(bytes, 0);
  std::uint32_t x = 0x85EBCA6Bu ^ (layer * 7919u + expert * 104729u + 1u);
  for (std::uint64_t i = 0; i + 2 <= bytes; i += 2) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    const std::uint16_t v = std::uint16_t(0x3C00u + (x % 0x380u)) | std::uint16_t((x >> 31) << 15);
    std::memcpy(r.data() + i, &v, 2);
  }
  return r;
}

}  // namespace

std::string build_test_pack(const TestGeometry& g, const std::string& name,
                            std::uint32_t weight_format, std::uint32_t group_size,
                            std::uint32_t scale_format) {
  const std::uint64_t keys = std::uint64_t(g.n_layers) * g.n_experts;
  const std::string meta = "{\"format\": \"strata-pack\", \"version\": 2, \"source\": \"c++ test\"}";
  std::vector<unsigned char> h = make_header(g, weight_format, group_size, scale_format,
                                             meta.size());
  const std::uint64_t record_bytes = get_field<std::uint64_t>(h, 56);
  const std::uint64_t stride = get_field<std::uint64_t>(h, 64);
  const std::uint64_t router_offset = get_field<std::uint64_t>(h, 88);
  const std::uint64_t checksum_offset = get_field<std::uint64_t>(h, 104);
  const std::uint64_t records_offset = get_field<std::uint64_t>(h, 120);
  const std::uint64_t file_bytes = get_field<std::uint64_t>(h, 128);
  put<std::uint32_t>(h, 140, crc32_bytes(meta.data(), meta.size()));
  rehash(h);

  std::string path = temp_dir() + "/strata_cpp_" + name + "_" + std::to_string(::getpid()) + ".strpk";
  int fd = ::open(path.c_str(), O_CREAT | O_TRUNC | O_WRONLY, 0644);
  if (fd < 0) throw std::runtime_error("cannot create " + path);
  auto write_at = [&](std::uint64_t off, const void* p, std::size_t n) {
    if (::pwrite(fd, p, n, off_t(off)) != ssize_t(n)) throw std::runtime_error("write failed");
  };
  write_at(0, h.data(), h.size());
  write_at(kHeaderBytes, meta.data(), meta.size());
  std::vector<float> router(std::size_t(g.n_experts) * g.hidden);
  for (std::uint32_t l = 0; l < g.n_layers; ++l) {
    for (std::size_t i = 0; i < router.size(); ++i) router[i] = float(int((i * 31 + l) % 17) - 8) / 8.f;
    write_at(router_offset + l * router.size() * 4, router.data(), router.size() * 4);
  }
  std::vector<std::uint32_t> crcs(keys);
  for (std::uint32_t l = 0; l < g.n_layers; ++l)
    for (std::uint32_t e = 0; e < g.n_experts; ++e) {
      auto rec = weight_format == 0 ? expected_record(g, l, e)
                                    : quantized_record(record_bytes, l, e);
      if (weight_format == 5)  // mxfp4: E8M0 exponents near 2^-5, so values stay finite
        for (std::uint32_t t = 0; t < get_field<std::uint32_t>(h, 136); ++t)
          if (get_field<std::uint32_t>(h, 144 + 32 * t + 4) == 1) {
            const std::uint64_t off = get_field<std::uint64_t>(h, 144 + 32 * t + 8);
            const std::uint64_t n = get_field<std::uint64_t>(h, 144 + 32 * t + 16);
            for (std::uint64_t i = 0; i < n; ++i) rec[off + i] = 120 + rec[off + i] % 4;
          }
      std::uint64_t key = std::uint64_t(l) * g.n_experts + e;
      crcs[key] = crc32c(rec.data(), rec.size());
      write_at(records_offset + key * stride, rec.data(), rec.size());
    }
  write_at(checksum_offset, crcs.data(), crcs.size() * 4);
  if (::ftruncate(fd, off_t(file_bytes)) != 0) throw std::runtime_error("ftruncate failed");
  ::close(fd);
  return path;
}

void poke(const std::string& path, std::uint64_t offset, const void* data, std::size_t n) {
  int fd = ::open(path.c_str(), O_WRONLY);
  if (fd < 0 || ::pwrite(fd, data, n, off_t(offset)) != ssize_t(n))
    throw std::runtime_error("poke failed");
  ::close(fd);
}

void truncate_to(const std::string& path, std::uint64_t size) {
  if (::truncate(path.c_str(), off_t(size)) != 0) throw std::runtime_error("truncate failed");
}

}  // namespace strata::test
