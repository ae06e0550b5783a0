// The pieces of MLX's CPU arithmetic on their own: bfloat16 rounding (nearest-even, NaN kept,
// overflow to infinity as MLX's conversion does), MLX's exp and sigmoid at their edges. The
// end-to-end oracle is MLX itself (tests/test_mlx_lm_families.py, bitwise); these pin the
// corners that a random model rarely reaches.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <limits>

#include "cpu/mlx_arithmetic.h"

using namespace strata::cpu;

namespace {

float from_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace

TEST_CASE("mlx arithmetic: bfloat16 rounds to nearest, ties to even") {
  REQUIRE(mlx::round_bf16(1.0f + std::ldexp(1.0f, -8)) == 1.0f);  // tie: down to even
  REQUIRE(mlx::round_bf16(1.0f + 3 * std::ldexp(1.0f, -8)) == 1.0f + std::ldexp(1.0f, -6));
  REQUIRE(mlx::round_bf16(1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20)) ==
          1.0f + std::ldexp(1.0f, -7));
  REQUIRE(mlx::round_bf16(-2.5f) == -2.5f);
  const float inf = std::numeric_limits<float>::infinity();
  REQUIRE(mlx::round_bf16(inf) == inf);
  REQUIRE(mlx::round_bf16(from_bits(0x7F7FFFFFu)) == inf);  // the largest float overflows
  REQUIRE(std::isnan(mlx::round_bf16(from_bits(0x7F800001u))));  // a low-payload NaN stays NaN
}

TEST_CASE("mlx arithmetic: exp and sigmoid at their edges") {
  const float inf = std::numeric_limits<float>::infinity();
  REQUIRE(mlx::exp(0.0f) == 1.0f);
  REQUIRE(std::fabs(mlx::exp(1.0f) - std::exp(1.0f)) <= 1e-6f * std::exp(1.0f));
  REQUIRE(mlx::exp(88.5f) == inf);
  REQUIRE(mlx::exp(-88.5f) == 0.0f);
  REQUIRE(std::isnan(mlx::exp(std::nanf(""))));
  REQUIRE(mlx::sigmoid<mlx::Bf16>(0.0f) == 0.5f);
  REQUIRE(mlx::sigmoid<mlx::Bf16>(200.0f) == 1.0f);
  REQUIRE(mlx::sigmoid<mlx::Bf16>(-200.0f) == 0.0f);
  REQUIRE(mlx::sigmoid<mlx::F32>(-3.0f) == 1.0f / (1.0f + mlx::exp(3.0f)));
  // MLX's minimum/maximum let a NaN through from either side.
  REQUIRE(std::isnan(mlx::minimum(std::nanf(""), 1.0f)));
  REQUIRE(std::isnan(mlx::minimum(1.0f, std::nanf(""))));
  REQUIRE(std::isnan(mlx::swiglu_oai<mlx::Bf16>(std::nanf(""), 1.0f, 1.702f, 7.0f)));
  REQUIRE(mlx::swiglu_oai<mlx::Bf16>(100.0f, 100.0f, 1.702f, 7.0f) ==
          mlx::swiglu_oai<mlx::Bf16>(7.0f, 7.0f, 1.702f, 7.0f));  // both clamp at the limit
}
