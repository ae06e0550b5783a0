#include "weights.h"

namespace strata {
namespace {

inline float load_scale(const unsigned char* p, std::uint32_t i, std::uint32_t fmt) {
  if (fmt == 0) {
    float f;
    std::memcpy(&f, p + 4 * i, 4);
    return f;
  }
  std::uint16_t h;
  std::memcpy(&h, p + 2 * i, 2);
  return fmt == 1 ? half_to_float(h) : bf16_to_float(h);
}

}  // namespace

void MatrixView::row(std::uint32_t r, float* out) const {
  switch (format) {
    case WeightFormat::F32:
      std::memcpy(out, weight + std::size_t(r) * cols * 4, std::size_t(cols) * 4);
      return;
    case WeightFormat::F16:
    case WeightFormat::BF16: {
      const unsigned char* p = weight + std::size_t(r) * cols * 2;
      for (std::uint32_t c = 0; c < cols; ++c) {
        std::uint16_t h;
        std::memcpy(&h, p + 2 * c, 2);
        out[c] = format == WeightFormat::F16 ? half_to_float(h) : bf16_to_float(h);
      }
      return;
    }
    case WeightFormat::Q4:
    case WeightFormat::Q8: {
      const std::uint32_t bits = format == WeightFormat::Q4 ? 4 : 8;
      const std::uint32_t per_word = 32 / bits, mask = (1u << bits) - 1;
      const std::uint32_t words = cols / per_word, groups = cols / group_size;
      const unsigned char* w = weight + std::size_t(r) * words * 4;
      for (std::uint32_t g = 0; g < groups; ++g) {
        const float s = load_scale(scales, r * groups + g, scale_format);
        const float b = load_scale(biases, r * groups + g, scale_format);
        for (std::uint32_t c = g * group_size; c < (g + 1) * group_size; c += per_word) {
          std::uint32_t word;
          std::memcpy(&word, w + 4 * (c / per_word), 4);
          for (std::uint32_t n = 0; n < per_word; ++n)
            out[c + n] = s * float((word >> (n * bits)) & mask) + b;  // MLX affine dequant
        }
      }
      return;
    }
  }
}

ExpertView expert_view(const PackLayout& L, const unsigned char* base) {
  ExpertView v;
  MatrixView* m[3] = {&v.gate, &v.up, &v.down};
  for (const TensorEntry& t : L.tensors) {
    MatrixView& mv = *m[t.matrix];
    const unsigned char* p = base + t.offset;
    if (t.role == 0) mv.weight = p;
    if (t.role == 1) mv.scales = p;
    if (t.role == 2) mv.biases = p;
    mv.rows = t.matrix == 2 ? L.hidden : L.moe_intermediate;
    mv.cols = t.matrix == 2 ? L.moe_intermediate : L.hidden;
    mv.format = L.weight_format;
    mv.group_size = L.group_size;
    mv.scale_format = L.scale_format;
  }
  return v;
}

}  // namespace strata
