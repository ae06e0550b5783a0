// matrix_dots (the CPU backend's expert passes) against the reference it must equal bit for
// bit: MatrixView::row then dot, for every weight format, group size and scale format, row
// ranges that do and do not fill its row blocks, input counts that do and do not fill its entry
// blocks (on both of its paths: dequantized in registers for a few inputs, through a tile for
// many), and widths that are and are not multiples of dot's 16 lanes.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cpu/cpu_kernels.h"
#include "pack/weights.h"

using namespace strata;

namespace {

std::uint32_t bits_of(float f) {
  std::uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

std::uint16_t top_half(float f) { return std::uint16_t(bits_of(f) >> 16); }

std::uint16_t to_half(float f) {  // finite, normal-range values only
  const std::uint32_t b = bits_of(f);
  const std::uint32_t sign = (b >> 16) & 0x8000u;
  const std::int32_t exp = std::int32_t((b >> 23) & 0xFF) - 127 + 15;
  if (exp <= 0) return std::uint16_t(sign);
  return std::uint16_t(sign | (std::uint32_t(exp) << 10) | ((b >> 13) & 0x3FFu));
}

// One random matrix of `format`, owning its bytes.
struct Matrix {
  std::vector<unsigned char> weight, scales, biases;
  MatrixView view;
  Matrix(WeightFormat format, std::uint32_t rows, std::uint32_t cols, std::uint32_t group_size,
         std::uint32_t scale_format, std::mt19937& rng) {
    std::normal_distribution<float> nd;
    const std::size_t n = std::size_t(rows) * cols;
    auto put_floats = [&](std::vector<unsigned char>& out, std::size_t count, std::uint32_t fmt,
                          float scale) {
      out.resize(count * (fmt == 0 ? 4 : 2));
      for (std::size_t i = 0; i < count; ++i) {
        const float v = nd(rng) * scale;
        if (fmt == 0) {
          std::memcpy(out.data() + 4 * i, &v, 4);
        } else {
          const std::uint16_t h = fmt == 1 ? to_half(v) : top_half(v);
          std::memcpy(out.data() + 2 * i, &h, 2);
        }
      }
    };
    switch (format) {
      case WeightFormat::F32: put_floats(weight, n, 0, 0.1f); break;
      case WeightFormat::F16: put_floats(weight, n, 1, 0.1f); break;
      case WeightFormat::BF16: put_floats(weight, n, 2, 0.1f); break;
      case WeightFormat::Q4:
      case WeightFormat::Q8: {
        weight.resize(n * (format == WeightFormat::Q4 ? 4 : 8) / 8);
        for (auto& byte : weight) byte = static_cast<unsigned char>(rng());
        put_floats(scales, n / group_size, scale_format, 0.01f);
        put_floats(biases, n / group_size, scale_format, 0.05f);
        break;
      }
      case WeightFormat::Mxfp4: {
        weight.resize(n / 2);
        for (auto& byte : weight) byte = static_cast<unsigned char>(rng());
        scales.resize(n / group_size);
        for (auto& e : scales) e = static_cast<unsigned char>(120 + rng() % 10);  // 2^-7..2^2
        break;
      }
    }
    view.weight = weight.data();
    view.scales = scales.empty() ? nullptr : scales.data();
    view.biases = biases.empty() ? nullptr : biases.data();
    view.rows = rows;
    view.cols = cols;
    view.format = format;
    view.group_size = group_size;
    view.scale_format = scale_format;
  }
};

void require_dots_exact(const MatrixView& m, std::mt19937& rng) {
  std::normal_distribution<float> nd;
  std::vector<float> row(m.cols), tile;
  for (std::uint32_t n_x : {1u, 2u, 3u, 4u, 5u, 6u, 7u, 8u, 9u, 16u}) {
    std::vector<std::vector<float>> inputs(n_x, std::vector<float>(m.cols));
    std::vector<const float*> xs;
    for (auto& x : inputs) {
      for (float& v : x) v = nd(rng);
      xs.push_back(x.data());
    }
    for (auto [r0, r1] : {std::pair{0u, m.rows}, std::pair{1u, m.rows - 2}, std::pair{3u, 4u}}) {
      std::vector<float> out(std::size_t(r1 - r0) * n_x);
      cpu::matrix_dots(m, r0, r1, xs.data(), n_x, out.data(), tile);
      for (std::uint32_t r = r0; r < r1; ++r) {
        m.row(r, row.data());
        for (std::uint32_t e = 0; e < n_x; ++e) {
          INFO("row " << r << " of [" << r0 << ", " << r1 << "), input " << e << " of " << n_x);
          REQUIRE(bits_of(out[std::size_t(r - r0) * n_x + e]) ==
                  bits_of(cpu::dot(row.data(), xs[e], m.cols)));
        }
      }
    }
  }
}

}  // namespace

TEST_CASE("matrix_dots is row then dot, bit for bit, for every weight format") {
  std::mt19937 rng(36);
  struct Case {
    WeightFormat format;
    std::uint32_t cols, group_size, scale_format;
  };
  const Case cases[] = {
      {WeightFormat::Q4, 256, 32, 0},  {WeightFormat::Q4, 256, 64, 2},
      {WeightFormat::Q4, 384, 128, 1}, {WeightFormat::Q4, 96, 32, 2},  // 96: 16 past a 32
      // 16 or more groups a row: the scales widen 16 at a time, then one by one
      {WeightFormat::Q4, 1280, 64, 1}, {WeightFormat::Q4, 1024, 32, 2},
      // groups of 16 columns: one nibble step a group
      {WeightFormat::Q4, 160, 16, 1},  {WeightFormat::Mxfp4, 2048, 32, 0},
      {WeightFormat::Q8, 640, 32, 1},
      {WeightFormat::Q8, 256, 64, 2},  {WeightFormat::Q8, 128, 32, 0},
      {WeightFormat::Q8, 48, 16, 1},   {WeightFormat::Mxfp4, 256, 32, 0},
      {WeightFormat::Mxfp4, 96, 32, 0}, {WeightFormat::BF16, 272, 0, 0},
      {WeightFormat::F16, 64, 0, 0},   {WeightFormat::F32, 80, 0, 0},
      // widths off dot's 16 lanes: its scalar tail
      {WeightFormat::BF16, 40, 0, 0},  {WeightFormat::F32, 13, 0, 0},
      {WeightFormat::Q4, 40, 8, 2},
  };
  for (const Case& c : cases) {
    const std::uint32_t rows = 11;  // two full row blocks of 4 and a partial one
    Matrix m(c.format, rows, c.cols, c.group_size, c.scale_format, rng);
    if (c.scale_format == 1 && m.scales.size() > 2 * 40) {
      // An infinite f16 scale: its block of scales widens one by one, as scale_value does.
      const std::uint16_t inf = 0x7C00;
      std::memcpy(m.scales.data() + 2 * 40, &inf, 2);
    }
    INFO("format " << int(c.format) << " cols " << c.cols << " group " << c.group_size
                   << " scales " << c.scale_format);
    require_dots_exact(m.view, rng);
  }
}
