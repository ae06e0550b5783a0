// Expert weights as the kernels see them: one record's bytes plus the pack's tensor table.
// Every weight format dequantizes a row into float32 exactly the same way everywhere, so the
// decode, prompt and wave paths all compute bit-identical results (I11).
#pragma once

#include <cstdint>
#include <cstring>

#include "pack/pack_file.h"

namespace strata {

inline float half_to_float(std::uint16_t h) {
  const std::uint32_t sign = std::uint32_t(h & 0x8000u) << 16;
  std::uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while (!(mant & 0x400u)) {
        mant <<= 1;
        --exp;
      }
      bits = sign | (exp << 23) | ((mant & 0x3FFu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7F800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float bf16_to_float(std::uint16_t b) {
  std::uint32_t bits = std::uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Element i of a scale-format array (0 f32, 1 f16, 2 bf16) as float32: an exact widening.
inline float scale_value(const unsigned char* p, std::uint32_t i, std::uint32_t fmt) {
  if (fmt == 0) {
    float f;
    std::memcpy(&f, p + 4 * i, 4);
    return f;
  }
  std::uint16_t h;
  std::memcpy(&h, p + 2 * i, 2);
  return fmt == 1 ? half_to_float(h) : bf16_to_float(h);
}

// An E2M1 (FP4) code's value, as MLX's FP4_LUT: sign bit 3, then 2 exponent bits and 1 mantissa.
inline constexpr float kFp4Values[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                         -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// An E8M0 scale (2^(e - 127)) as MLX decodes it: the exponent moved into a bfloat16's exponent
// bits, so 0 gives bfloat16 0x0040 (2^-127, a subnormal) and 255 gives infinity, not NaN.
inline float e8m0_to_float(std::uint8_t e) {
  return bf16_to_float(e == 0 ? std::uint16_t(0x0040) : std::uint16_t(std::uint16_t(e) << 7));
}

// One matrix (gate, up or down) of one expert record.
struct MatrixView {
  const unsigned char* weight = nullptr;
  const unsigned char* scales = nullptr;
  const unsigned char* biases = nullptr;
  const unsigned char* bias = nullptr;  // the Linear's own bias [rows], null when none
  std::uint32_t rows = 0, cols = 0;  // logical shape
  WeightFormat format = WeightFormat::F32;
  std::uint32_t group_size = 0, scale_format = 0;
  std::uint32_t bias_format = 0;  // as PackLayout::bias_format

  // Writes row r, dequantized, into out[cols].
  void row(std::uint32_t r, float* out) const;
  // The Linear bias of output r as float32 (exact widening); 0 without biases.
  float bias_at(std::uint32_t r) const;
};

// The three matrices of the record at `base`, and the activation between them. Gateless
// experts (gated false) have no gate: `gate` is empty and the activation reads up alone.
struct ExpertView {
  MatrixView gate, up, down;
  Activation activation = Activation::SwiGLU;
  float act_alpha = 0, act_limit = 0;
  bool gated = true;
};

// The record of pack layer `layer` at `base` (its format class's tensor table and formats).
ExpertView expert_view(const PackLayout& L, std::uint32_t layer, const unsigned char* base);

}  // namespace strata
