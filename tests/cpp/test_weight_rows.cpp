// MatrixView::row against the one-element conversions it must equal bit for bit: the vector
// paths (bfloat16 eight at a time) and their scalar tails, on widths that are and are not
// multiples of the vector.
#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "pack/weights.h"

using namespace strata;

namespace {

std::uint32_t bits_of(float f) {
  std::uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

// Every row of a [rows, cols] matrix of 16-bit elements `w` in `format`, against `one` applied
// to each element.
template <class One>
void require_rows(const std::vector<std::uint16_t>& w, std::uint32_t rows, std::uint32_t cols,
                  WeightFormat format, One one) {
  MatrixView m;
  m.weight = reinterpret_cast<const unsigned char*>(w.data());
  m.rows = rows;
  m.cols = cols;
  m.format = format;
  std::vector<float> out(cols);
  for (std::uint32_t r = 0; r < rows; ++r) {
    m.row(r, out.data());
    for (std::uint32_t c = 0; c < cols; ++c)
      REQUIRE(bits_of(out[c]) == bits_of(one(w[std::size_t(r) * cols + c])));
  }
}

}  // namespace

TEST_CASE("bfloat16 rows widen exactly, element for element, at every width") {
  std::mt19937 rng(7);
  for (std::uint32_t cols : {1u, 7u, 8u, 13u, 16u, 100u, 2048u}) {
    const std::uint32_t rows = 3;
    std::vector<std::uint16_t> w(std::size_t(rows) * cols);
    for (auto& h : w) h = std::uint16_t(rng());  // every pattern: NaN, inf, subnormal, -0
    w[0] = 0x7fc1;                               // a NaN payload must survive
    w[w.size() - 1] = 0x8000;                    // and -0
    require_rows(w, rows, cols, WeightFormat::BF16, bf16_to_float);
  }
}

TEST_CASE("float16 rows widen exactly: every one of the 65536 patterns") {
  std::vector<std::uint16_t> w(65536);
  for (std::uint32_t i = 0; i < w.size(); ++i) w[i] = std::uint16_t(i);
  require_rows(w, 8192, 8, WeightFormat::F16, half_to_float);  // the vector path alone
  require_rows(w, 4096, 16, WeightFormat::F16, half_to_float);
}

TEST_CASE("float16 rows widen exactly, element for element") {
  std::mt19937 rng(11);
  const std::uint32_t rows = 2, cols = 37;
  std::vector<std::uint16_t> w(std::size_t(rows) * cols);
  for (auto& h : w) h = std::uint16_t(rng());
  require_rows(w, rows, cols, WeightFormat::F16, half_to_float);
}
