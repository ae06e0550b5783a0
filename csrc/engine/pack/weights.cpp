#include "pack/weights.h"

#include "common/fused_madd.h"

namespace strata {
namespace {

typedef std::uint16_t h8v __attribute__((vector_size(16)));
typedef std::uint32_t u8v __attribute__((vector_size(32)));

// A bfloat16 is the top half of its float32: eight at a time as a vector shift (the conversion
// is exact, so this is bf16_to_float's value element for element).
void bf16_row(const unsigned char* p, std::uint32_t cols, float* out) {
  std::uint32_t c = 0;
  for (; c + 8 <= cols; c += 8) {
    h8v h;
    std::memcpy(&h, p + 2 * c, 16);
    const u8v bits = __builtin_convertvector(h, u8v) << 16;
    std::memcpy(out + c, &bits, 32);
  }
  for (; c < cols; ++c) {
    std::uint16_t h;
    std::memcpy(&h, p + 2 * c, 2);
    out[c] = bf16_to_float(h);
  }
}

// half_to_float eight at a time, branch-free and exact: normal numbers by rebiasing the
// exponent, infinities and NaNs (payload kept) by their pattern, zeros and subnormals as
// mantissa * 2^-24 (an integer below 1024 converted exactly, times a power of two whose
// product is a normal float32, so flush-to-zero modes cannot touch it).
void f16_row(const unsigned char* p, std::uint32_t cols, float* out) {
  std::uint32_t c = 0;
  for (; c + 8 <= cols; c += 8) {
    h8v h;
    std::memcpy(&h, p + 2 * c, 16);
    const u8v x = __builtin_convertvector(h, u8v);
    const u8v sign = (x & 0x8000u) << 16, exp = (x >> 10) & 0x1Fu, mant = x & 0x3FFu;
    const u8v normal = sign | ((exp + (127u - 15u)) << 23) | (mant << 13);
    const u8v special = sign | 0x7F800000u | (mant << 13);
    const f8v small = __builtin_convertvector(mant, f8v) * 0x1p-24f;
    u8v small_bits;
    std::memcpy(&small_bits, &small, 32);
    const u8v is_small = u8v(exp == 0u), is_special = u8v(exp == 31u);
    const u8v bits = ((small_bits | sign) & is_small) | (special & is_special) |
                     (normal & ~(is_small | is_special));
    std::memcpy(out + c, &bits, 32);
  }
  for (; c < cols; ++c) {
    std::uint16_t h;
    std::memcpy(&h, p + 2 * c, 2);
    out[c] = half_to_float(h);
  }
}

// MLX affine dequant of one group, w = s * q + b (fused: common/fused_madd.h), one 32-bit word at a time as a vector of its
// 8 (q4) or 4 (q8, two words at once) codes: vector extensions make this AVX2/NEON.
void affine_group(const std::uint32_t* gw, std::uint32_t group_words, std::uint32_t bits,
                  float s, float b, float* o) {
  const f8v sv = {s, s, s, s, s, s, s, s}, bv = {b, b, b, b, b, b, b, b};
  if (bits == 4) {
    const u8v shift = {0, 4, 8, 12, 16, 20, 24, 28};
    for (std::uint32_t i = 0; i < group_words; ++i) {
      const u8v word = {gw[i], gw[i], gw[i], gw[i], gw[i], gw[i], gw[i], gw[i]};
      const f8v q = __builtin_convertvector((word >> shift) & 15u, f8v);
      const f8v v = fused_madd8(bv, sv, q);
      std::memcpy(o + 8 * i, &v, 32);
    }
  } else {
    const u8v shift = {0, 8, 16, 24, 0, 8, 16, 24};
    for (std::uint32_t i = 0; i < group_words; i += 2) {  // group_words is even
      const u8v word = {gw[i], gw[i], gw[i], gw[i], gw[i + 1], gw[i + 1], gw[i + 1], gw[i + 1]};
      const f8v q = __builtin_convertvector((word >> shift) & 255u, f8v);
      const f8v v = fused_madd8(bv, sv, q);
      std::memcpy(o + 4 * i, &v, 32);
    }
  }
}

void affine_row(const MatrixView& m, std::uint32_t r, float* out) {
  const std::uint32_t bits = m.format == WeightFormat::Q4 ? 4 : 8;
  const std::uint32_t per_word = 32 / bits;
  const std::uint32_t words = m.cols / per_word, groups = m.cols / m.group_size;
  const std::uint32_t* w =
      reinterpret_cast<const std::uint32_t*>(m.weight + std::size_t(r) * words * 4);
  const std::uint32_t group_words = m.group_size / per_word;
  for (std::uint32_t g = 0; g < groups; ++g) {
    const float s = scale_value(m.scales, r * groups + g, m.scale_format);
    const float b = scale_value(m.biases, r * groups + g, m.scale_format);
    affine_group(w + g * group_words, group_words, bits, s, b, out + g * m.group_size);
  }
}

// MLX's dequantize for mxfp4: w = FP4(q) * 2^(e - 127); both factors are exact in float32 and
// their product is too (at most 3 significant bits), so this is MLX's value exactly.
void mxfp4_row(const MatrixView& m, std::uint32_t r, float* out) {
  const std::uint32_t words = m.cols / 8, groups = m.cols / m.group_size;
  const std::uint32_t* w =
      reinterpret_cast<const std::uint32_t*>(m.weight + std::size_t(r) * words * 4);
  for (std::uint32_t g = 0; g < groups; ++g) {
    const float s = e8m0_to_float(m.scales[std::size_t(r) * groups + g]);
    for (std::uint32_t c = g * m.group_size; c < (g + 1) * m.group_size; ++c)
      out[c] = kFp4Values[(w[c / 8] >> (4 * (c % 8))) & 15u] * s;
  }
}

}  // namespace

void MatrixView::row(std::uint32_t r, float* out) const {
  switch (format) {
    case WeightFormat::F32:
      std::memcpy(out, weight + std::size_t(r) * cols * 4, std::size_t(cols) * 4);
      return;
    case WeightFormat::BF16:
      return bf16_row(weight + std::size_t(r) * cols * 2, cols, out);
    case WeightFormat::F16:
      return f16_row(weight + std::size_t(r) * cols * 2, cols, out);
    case WeightFormat::Q4:
    case WeightFormat::Q8:
      return affine_row(*this, r, out);
    case WeightFormat::Mxfp4:
      return mxfp4_row(*this, r, out);
  }
}

float MatrixView::bias_at(std::uint32_t r) const {
  return bias ? scale_value(bias, r, bias_format - 1) : 0.0f;
}

ExpertView expert_view(const PackLayout& L, std::uint32_t layer, const unsigned char* base) {
  ExpertView v;
  v.activation = L.activation;
  v.act_alpha = L.act_alpha;
  v.act_limit = L.act_limit;
  v.gated = L.gated;
  MatrixView* m[3] = {&v.gate, &v.up, &v.down};
  const LayerFormat& formats = L.formats_of(layer);
  for (const TensorEntry& t : L.tensors_of(layer)) {
    MatrixView& mv = *m[t.matrix];
    const unsigned char* p = base + t.offset;
    if (t.role == 0) mv.weight = p;
    if (t.role == 1) mv.scales = p;
    if (t.role == 2) mv.biases = p;
    if (t.role == kRoleBias) mv.bias = p;
    mv.bias_format = L.bias_format;
    mv.rows = t.matrix == 2 ? L.hidden : L.moe_intermediate;
    mv.cols = t.matrix == 2 ? L.moe_intermediate : L.hidden;
    mv.format = formats[t.matrix].format;
    mv.group_size = formats[t.matrix].group_size;
    mv.scale_format = formats[t.matrix].scale_format;
  }
  return v;
}

}  // namespace strata
