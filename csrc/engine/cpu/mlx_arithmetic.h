// MLX's CPU arithmetic, reproduced: the roundings, exp and sigmoid of MLX's CPU kernels, so the
// CPU backend can compute a block exactly as mlx-lm does on the CPU (Arithmetic::Mlx*).
//
// What MLX does (mlx/backend/cpu; checked bitwise against MLX 0.32 by tests/cpp/test_mlx_arithmetic
// (rounding, exp, sigmoid) and tests/test_mlx_lm_families.py (whole blocks and models)):
// - bfloat16 values are float32 with the low 16 bits rounded away to nearest-even; every binary
//   op on two bfloat16 values computes in float32 and rounds the result back to bfloat16;
// - the quantized matmul (no SIMD on x86-64) walks k in order: w = (s * q) + b and x * w and
//   sum + x * w each rounded to the activation dtype; for mxfp4 (fp_qmm_t), per group of 32
//   gsum + x * FP4(q), then sum + scale * gsum, each rounded likewise;
// - exp is a Cephes-style polynomial (a float32 fma chain), not libm; sigmoid(x) is
//   1 / (1 + exp(|x|)) mirrored for x >= 0, with exp's result rounded to the dtype.
// Float32 rounds nothing: the same op order, no fused multiply-add (the kernels' file is
// compiled with -ffp-contract=off). The functions have internal linkage: every file that
// includes this compiles its own copy with its own flags, so no copy built for one ISA or
// contraction setting can stand in for another at link time.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace strata::cpu::mlx {

// Round-to-nearest-even to bfloat16, kept as float32; NaN stays NaN (the bit trick alone would
// carry a NaN's payload into infinity).
static inline float round_bf16(float f) {
  if (f != f) return std::numeric_limits<float>::quiet_NaN();
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  u = (u + ((u >> 16) & 1u) + 0x7FFFu) & 0xFFFF0000u;
  std::memcpy(&f, &u, 4);
  return f;
}

// The rounding of one dtype, as a policy for the kernels' templates.
struct Bf16 {
  static float one(float f) { return round_bf16(f); }
};
struct F32 {
  static float one(float f) { return f; }
};

// MLX's exp (simd::exp): 2^(x log2 e) as 2^ipart (exponent bits) times a degree-6 polynomial
// in the fraction, evaluated with fma.
static inline float exp(float x_init) {
  float x = x_init * 1.442695f;
  // MLX adds a double 0.5, so the floor is taken in double.
  const float ipart = float(std::floor(double(x) + 0.5));
  const float fpart = x - ipart;
  x = 1.535336188319500e-4f;
  x = std::fma(x, fpart, 1.339887440266574e-3f);
  x = std::fma(x, fpart, 9.618437357674640e-3f);
  x = std::fma(x, fpart, 5.550332471162809e-2f);
  x = std::fma(x, fpart, 2.402264791363012e-1f);
  x = std::fma(x, fpart, 6.931472028550421e-1f);
  x = std::fma(x, fpart, 1.000000000000000f);
  if (x_init != x_init) return x_init;
  if (x_init > 88.0f) return std::numeric_limits<float>::infinity();
  if (x_init < -88.0f) return 0.0f;
  const std::int32_t e = (std::int32_t(ipart) + 127) << 23;
  float two_i;
  std::memcpy(&two_i, &e, 4);
  return two_i * x;
}

// MLX's sigmoid of a value of dtype R.
template <class R>
static inline float sigmoid(float x) {
  const float y = 1.0f / (1.0f + R::one(exp(std::fabs(x))));
  return R::one(x < 0.0f ? y : 1.0f - y);
}

// MLX's minimum / maximum: a NaN operand wins (std::fmin would drop it).
static inline float minimum(float a, float b) { return a != a ? a : (b != b ? b : (a < b ? a : b)); }
static inline float maximum(float a, float b) { return a != a ? a : (b != b ? b : (a > b ? a : b)); }

// mlx-lm's swiglu: silu(g) * u with silu(g) = g * sigmoid(g), each op rounded.
template <class R>
static inline float swiglu(float g, float u) {
  return R::one(R::one(g * sigmoid<R>(g)) * u);
}

// mlx-lm's swiglu_oai (gpt-oss): alpha and limit are Python scalars, so MLX casts them to the
// dtype first; then (clip(u) + 1) * (g' * sigmoid(alpha g')) with g' = min(g, limit).
template <class R>
static inline float swiglu_oai(float g, float u, float alpha, float limit) {
  const float a = R::one(alpha), lim = R::one(limit);
  const float gc = minimum(g, lim);
  const float uc = minimum(maximum(u, -lim), lim);
  return R::one(R::one(uc + 1.0f) * R::one(gc * sigmoid<R>(R::one(a * gc))));
}

}  // namespace strata::cpu::mlx
