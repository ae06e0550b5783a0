#include "cpu/mlx_kernels.h"

#include <algorithm>
#include <cstring>

#include "cpu/mlx_arithmetic.h"

namespace strata::cpu::mlx {
namespace {

constexpr std::uint32_t kLanes = 8;  // output rows computed side by side, one per vector lane

typedef float v8f __attribute__((vector_size(32)));
typedef std::uint32_t v8u __attribute__((vector_size(32)));

// The vector rounding of each dtype policy. Bf16: round_bf16 without the NaN guard: every
// value it rounds comes from bfloat16 operands (activations, scales, biases, earlier rounded
// results), and a NaN made from those carries its payload in the high 16 bits (or is x86's
// default NaN), which rounding keeps a NaN. Only a NaN with a payload confined to the low 16
// bits could turn into infinity, and none can arise here.
template <class R>
v8f round_vec(v8f v);
template <>
v8f round_vec<Bf16>(v8f v) {
  v8u u;
  std::memcpy(&u, &v, 32);
  u = (u + ((u >> 16) & 1u) + 0x7FFFu) & 0xFFFF0000u;
  std::memcpy(&v, &u, 32);
  return v;
}
template <>
v8f round_vec<F32>(v8f v) {
  return v;
}

// The packed words of rows [r, r + n), one row per lane; lanes >= n repeat row r.
struct LaneRows {
  const std::uint32_t* w[kLanes];
  std::uint32_t rows[kLanes];
  LaneRows(const MatrixView& m, std::uint32_t r, std::uint32_t n, std::uint32_t words) {
    for (std::uint32_t lane = 0; lane < kLanes; ++lane) {
      rows[lane] = r + (lane < n ? lane : 0);
      w[lane] = reinterpret_cast<const std::uint32_t*>(m.weight) + std::size_t(rows[lane]) * words;
    }
  }
};

// Rows [r, r + n) of m, dequantized as MLX does ((s * q) + b, each rounded), column by column:
// visit(v) gets column c of all lanes as one vector, c = 0, 1, ... in order. The transpose is
// free: one 32-bit word of each of the 8 rows makes a vector, and its codes at one shift are 8
// rows' codes of one column. Lanes >= n repeat row r; their results are never stored.
template <class R, std::uint32_t Bits, class Visit>
void walk_columns(const MatrixView& m, std::uint32_t r, std::uint32_t n, Visit&& visit) {
  constexpr std::uint32_t per_word = 32 / Bits, mask = (1u << Bits) - 1;
  const std::uint32_t words = m.cols / per_word, groups = m.cols / m.group_size;
  const std::uint32_t group_words = m.group_size / per_word;
  const LaneRows lr(m, r, n, words);
  const auto& w = lr.w;
  const auto& rows = lr.rows;
  for (std::uint32_t g = 0; g < groups; ++g) {
    v8f s, b;
    for (std::uint32_t lane = 0; lane < kLanes; ++lane) {
      s[lane] = scale_value(m.scales, rows[lane] * groups + g, m.scale_format);
      b[lane] = scale_value(m.biases, rows[lane] * groups + g, m.scale_format);
    }
    for (std::uint32_t i = g * group_words; i < (g + 1) * group_words; ++i) {
      const v8u word = {w[0][i], w[1][i], w[2][i], w[3][i], w[4][i], w[5][i], w[6][i], w[7][i]};
      for (std::uint32_t j = 0; j < per_word; ++j) {
        const v8f q = __builtin_convertvector((word >> (Bits * j)) & mask, v8f);
        visit(round_vec<R>(round_vec<R>(s * q) + b));
      }
    }
  }
}

template <class R, class Visit>
void walk_columns(const MatrixView& m, std::uint32_t r, std::uint32_t n, Visit&& visit) {
  if (m.format == WeightFormat::Q4)
    walk_columns<R, 4>(m, r, n, visit);
  else
    walk_columns<R, 8>(m, r, n, visit);
}

// The rows decoded into tile[c * kLanes + lane], for several entries to read.
template <class R>
void decode_tile(const MatrixView& m, std::uint32_t r, std::uint32_t n, float* tile) {
  walk_columns<R>(m, r, n, [&tile](v8f v) {
    std::memcpy(tile, &v, 32);
    tile += kLanes;
  });
}

// One step of MLX's quantized dot for all lanes: sum = sum + x * w, each op rounded.
template <class R>
v8f accumulate(v8f acc, float x, v8f w) {
  const v8f xv = {x, x, x, x, x, x, x, x};
  return round_vec<R>(acc + round_vec<R>(xv * w));
}

// The rows' dot with one x, decoding as it goes: the same steps in the same order as dot_lanes
// on a tile.
template <class R>
v8f fused_dot(const MatrixView& m, std::uint32_t r, std::uint32_t n, const float* x) {
  v8f acc = {};
  walk_columns<R>(m, r, n, [&](v8f w) { acc = accumulate<R>(acc, *x++, w); });
  return acc;
}

// MLX's quantized dot for kLanes rows at once: sum = sum + x[c] * w[c], k in order, each step
// rounded. The lanes are independent rows, so the vector keeps MLX's order in every lane.
template <class R>
v8f dot_lanes(const float* tile, const float* x, std::uint32_t cols) {
  v8f acc = {};
  for (std::uint32_t c = 0; c < cols; ++c) {
    v8f w;
    std::memcpy(&w, tile + std::size_t(c) * kLanes, 32);
    acc = accumulate<R>(acc, x[c], w);
  }
  return acc;
}

// mxfp4 (MLX's fp_qmm_t, which x86-64 runs without SIMD): per group of 32 columns,
// gsum = gsum + x * FP4(q), then sum = sum + scale * gsum, each op rounded. The FP4 values and
// E8M0 scales are exact in any dtype, so only the sums and products round. walk_mxfp4 visits a
// group's scales (begin), its columns in order (column) and its end (end) for kLanes rows.
template <class Visit>
void walk_mxfp4(const MatrixView& m, std::uint32_t r, std::uint32_t n, Visit&& visit) {
  const std::uint32_t words = m.cols / 8, groups = m.cols / m.group_size;
  const std::uint32_t group_words = m.group_size / 8;
  const LaneRows lr(m, r, n, words);
  const auto& w = lr.w;
  const auto& rows = lr.rows;
  for (std::uint32_t g = 0; g < groups; ++g) {
    v8f s;
    for (std::uint32_t lane = 0; lane < kLanes; ++lane)
      s[lane] = e8m0_to_float(m.scales[std::size_t(rows[lane]) * groups + g]);
    visit.begin(s);
    for (std::uint32_t i = g * group_words; i < (g + 1) * group_words; ++i)
      for (std::uint32_t j = 0; j < 8; ++j) {
        v8f q;
        for (std::uint32_t lane = 0; lane < kLanes; ++lane)
          q[lane] = kFp4Values[(w[lane][i] >> (4 * j)) & 15u];
        visit.column(q);
      }
    visit.end();
  }
}

// The grouped dot of walk_mxfp4's values with x, in MLX's order.
template <class R>
struct Mxfp4Dot {
  const float* x;
  v8f sum = {}, gsum = {}, scale = {};
  void begin(v8f s) {
    scale = s;
    gsum = v8f{};
  }
  void column(v8f q) { gsum = accumulate<R>(gsum, *x++, q); }
  void end() { sum = round_vec<R>(sum + round_vec<R>(scale * gsum)); }
};

// Rows [r, r + n) of one matrix, dotted with each entry's input: decoded once into a tile when
// several entries read them (a prompt), decoded on the fly when one does (decode: the tile
// would only round-trip through memory). The same steps in the same order either way.
template <class R>
class RowBlock {
 public:
  RowBlock(const MatrixView& m, std::size_t entries)
      : m_(m),
        mxfp4_(m.format == WeightFormat::Mxfp4),
        tile_(entries > 1 ? std::size_t(m.cols) * kLanes : 0),
        group_scales_(entries > 1 && mxfp4_ ? std::size_t(m.cols / m.group_size) * kLanes : 0) {}
  void load(std::uint32_t r, std::uint32_t n) {
    r_ = r;
    n_ = n;
    if (tile_.empty()) return;
    if (!mxfp4_) return decode_tile<R>(m_, r, n, tile_.data());
    struct {
      float *tile, *scales;
      void begin(v8f s) {
        std::memcpy(scales, &s, 32);
        scales += kLanes;
      }
      void column(v8f q) {
        std::memcpy(tile, &q, 32);
        tile += kLanes;
      }
      void end() {}
    } decode{tile_.data(), group_scales_.data()};
    walk_mxfp4(m_, r, n, decode);
  }
  v8f dot(const float* x) const {
    if (!mxfp4_)
      return tile_.empty() ? fused_dot<R>(m_, r_, n_, x) : dot_lanes<R>(tile_.data(), x, m_.cols);
    Mxfp4Dot<R> d{x};
    if (tile_.empty()) {
      walk_mxfp4(m_, r_, n_, d);
      return d.sum;
    }
    const float* q = tile_.data();
    const float* s = group_scales_.data();
    for (std::uint32_t c = 0; c < m_.cols; c += m_.group_size, s += kLanes) {
      v8f sv;
      std::memcpy(&sv, s, 32);
      d.begin(sv);
      for (std::uint32_t j = 0; j < m_.group_size; ++j, q += kLanes) {
        v8f qv;
        std::memcpy(&qv, q, 32);
        d.column(qv);
      }
      d.end();
    }
    return d.sum;
  }

 private:
  const MatrixView& m_;
  const bool mxfp4_;
  std::vector<float> tile_;          // affine: w values; mxfp4: FP4 values [col][lane]
  std::vector<float> group_scales_;  // mxfp4: E8M0 scales [group][lane]
  std::uint32_t r_ = 0, n_ = 0;
};

template <class R>
float activate(const ExpertView& ev, float g, float u) {
  if (ev.activation == Activation::SwiGLU) return swiglu<R>(g, u);
  return swiglu_oai<R>(g, u, ev.act_alpha, ev.act_limit);
}

template <class R>
void gate_up_typed(const DeviceBuffers& b, const ExpertView& ev,
                   const std::vector<std::uint32_t>& entries, std::uint32_t r0,
                   std::uint32_t r1) {
  const std::uint32_t H = b.layout->hidden, I = b.layout->moe_intermediate, k = b.layout->top_k;
  RowBlock<R> gate(ev.gate, entries.size()), up(ev.up, entries.size());
  for (std::uint32_t r = r0; r < r1; r += kLanes) {
    const std::uint32_t n = std::min(kLanes, r1 - r);
    gate.load(r, n);
    up.load(r, n);
    for (std::uint32_t i : entries) {
      const float* x = b.x + std::size_t(i / k) * H;
      const v8f g = gate.dot(x), u = up.dot(x);
      for (std::uint32_t lane = 0; lane < n; ++lane) {
        float gv = g[lane], uv = u[lane];
        // mlx-lm adds a SwitchLinear's bias after the matmul, one more rounded op.
        if (ev.gate.bias) gv = R::one(gv + ev.gate.bias_at(r + lane));
        if (ev.up.bias) uv = R::one(uv + ev.up.bias_at(r + lane));
        b.h[std::size_t(i) * I + r + lane] = activate<R>(ev, gv, uv);
      }
    }
  }
}

template <class R>
void down_typed(const DeviceBuffers& b, const ExpertView& ev,
                const std::vector<std::uint32_t>& entries, std::uint32_t r0, std::uint32_t r1,
                bool weights_bf16) {
  const std::uint32_t H = b.layout->hidden, I = b.layout->moe_intermediate;
  RowBlock<R> down(ev.down, entries.size());
  for (std::uint32_t r = r0; r < r1; r += kLanes) {
    const std::uint32_t n = std::min(kLanes, r1 - r);
    down.load(r, n);
    for (std::uint32_t i : entries) {
      const v8f d = down.dot(b.h + std::size_t(i) * I);
      for (std::uint32_t lane = 0; lane < n; ++lane) {
        float v = d[lane];
        if (ev.down.bias) v = R::one(v + ev.down.bias_at(r + lane));
        // The block's (y * scores): in the weights' dtype when they are bfloat16, else float32
        // (MLX promotes bfloat16 * float32 to float32). The sum over k is Combine's, in float32
        // and in k order, as MLX's reduction of either dtype is.
        const float p = b.weights[i] * v;
        b.y[std::size_t(i) * H + r + lane] = weights_bf16 ? round_bf16(p) : p;
      }
    }
  }
}

}  // namespace

const char* unsupported(const PackLayout& L, Arithmetic a, std::int32_t format_class) {
  if (a == Arithmetic::Float32) return "";
  // mlx-lm's own arithmetic is reproduced for its two gated activations only.
  if (!L.gated) return "MLX arithmetic is reproduced for gated experts only";
  switch (L.activation) {
    case Activation::SwiGLU:
    case Activation::SwigluOai:
      break;
    case Activation::SwigluClamp:
      return "MLX arithmetic is not reproduced for activation swiglu_clamp";
    case Activation::GegluTanh:
      return "MLX arithmetic is not reproduced for activation geglu_tanh";
    case Activation::SwigluSoftcap:
      return "MLX arithmetic is not reproduced for activation swiglu_softcap";
    case Activation::Relu2:
      return "MLX arithmetic is not reproduced for activation relu2";
  }
  const std::uint32_t want = a == Arithmetic::MlxBfloat16 ? 2 : 0;
  // Every matrix of the class asked about, or of every class (a mixed pack's formats differ
  // by layer or matrix); a layout made by hand, without classes, is its pack format throughout.
  const MatrixFormat pack{L.weight_format, L.group_size, L.scale_format};
  const std::vector<LayerFormat> uniform{LayerFormat{pack, pack, pack}};
  const std::vector<LayerFormat>& classes = L.classes.empty() ? uniform : L.classes;
  for (std::size_t c = 0; c < classes.size(); ++c)
    for (const MatrixFormat& f : classes[c]) {
      if (format_class >= 0 && c != std::size_t(format_class)) break;
      // MLX computes mxfp4 (u8 scales) in the activations' dtype, q4/q8 in the scales' dtype.
      const bool mxfp4 = f.format == WeightFormat::Mxfp4;
      if (!mxfp4 && f.format != WeightFormat::Q4 && f.format != WeightFormat::Q8)
        return "MLX arithmetic is reproduced for quantized (q4/q8/mxfp4) experts only";
      if (!mxfp4 && f.scale_format != want)
        return a == Arithmetic::MlxBfloat16
                   ? "MLX bfloat16 arithmetic needs bfloat16 scales (MLX computes in the scales' "
                     "dtype)"
                   : "MLX float32 arithmetic needs float32 scales (MLX computes in the scales' "
                     "dtype)";
      if (L.bias_format != 0 && L.bias_format != want + 1)
        return mxfp4 ? "MLX arithmetic needs the expert biases in the activations' dtype"
                     : "MLX arithmetic needs the expert biases in the scales' dtype";
    }
  return "";
}

void gate_up_rows(const DeviceBuffers& b, const ExpertView& ev,
                  const std::vector<std::uint32_t>& entries, std::uint32_t r0, std::uint32_t r1,
                  Rounding rounding) {
  if (rounding.arithmetic == Arithmetic::MlxBfloat16)
    gate_up_typed<Bf16>(b, ev, entries, r0, r1);
  else
    gate_up_typed<F32>(b, ev, entries, r0, r1);
}

void down_rows(const DeviceBuffers& b, const ExpertView& ev,
               const std::vector<std::uint32_t>& entries, std::uint32_t r0, std::uint32_t r1,
               Rounding rounding) {
  if (rounding.arithmetic == Arithmetic::MlxBfloat16)
    down_typed<Bf16>(b, ev, entries, r0, r1, rounding.weights_bf16);
  else
    down_typed<F32>(b, ev, entries, r0, r1, rounding.weights_bf16);
}

}  // namespace strata::cpu::mlx
