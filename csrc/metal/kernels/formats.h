// Pack weight formats as the mat-vec core reads them. Each lane owns a block of kBlock = 16
// consecutive columns; a format provides
//   prepare_x(x, k0, K, xr) -> sum of the block's x values; fills xr (registers), pre-scaled
//                              the way its block_dot wants them;
//   block_dot(m, row, k0, K, xr, xsum) -> the row's contribution over the block.
// Every floating-point step is an explicit fma or add in a fixed order, so one (row, token)
// always gets the same bits whichever kernel (decode pass or prompt wave) computes it (I11).
#pragma once

#include "common.h"

// The mat-vec's shape (matvec.h), one enum so the constants mix without conversions: a lane
// owns kBlock columns at a time; a threadgroup is kSimdsPerGroup simdgroups of kSimdWidth
// lanes, each owning kRowsPerSimd output rows.
enum : uint {
  kBlock = 16,
  kSimdWidth = 32,
  kRowsPerSimd = 4,
  kSimdsPerGroup = 2,
  kRowsPerGroup = kRowsPerSimd * kSimdsPerGroup,
};

// One matrix of one expert record (or a router): base pointers and the column count.
struct MatrixRef {
  device const uchar* w;
  device const uchar* s;  // quantized: scales [rows][cols / group]
  device const uchar* b;  // quantized: biases, same shape
  uint cols;
};

inline MatrixRef matrix_at(device const uchar* rec, ulong w, ulong s, ulong b, uint cols) {
  return MatrixRef{rec + w, rec + s, rec + b, cols};
}

// Plain x block, zero past K (float formats allow any K).
inline float load_x_block(device const float* x, uint k0, uint K, thread float* xr) {
  float sum = 0.0f;
  for (uint i = 0; i < kBlock; ++i) {
    xr[i] = k0 + i < K ? x[k0 + i] : 0.0f;
    sum += xr[i];
  }
  return sum;
}

// The x block as it is, for the formats whose block_dot wants it unscaled.
struct PlainX {
  static float prepare_x(device const float* x, uint k0, uint K, thread float* xr) {
    return load_x_block(x, k0, K, xr);
  }
};

// --- float formats: w[row][col] stored as float, half or bfloat16 bits ---------------------

struct LoadF32 {
  static float at(device const uchar* w, ulong i) { return ((device const float*)w)[i]; }
};
struct LoadF16 {
  static float at(device const uchar* w, ulong i) { return float(((device const half*)w)[i]); }
};
struct LoadBF16 {
  static float at(device const uchar* w, ulong i) {
    return as_type<float>(uint(((device const ushort*)w)[i]) << 16);
  }
};

template <class Load>
struct FloatFormat : PlainX {
  static float block_dot(thread const MatrixRef& m, uint row, uint k0, uint K,
                         thread const float* xr, float xsum) {
    (void)xsum;
    const ulong base = ulong(row) * m.cols + k0;
    float acc = 0.0f;
    if (k0 + kBlock <= K) {
      for (uint i = 0; i < kBlock; ++i) acc = fma(Load::at(m.w, base + i), xr[i], acc);
    } else {
      for (uint i = 0; k0 + i < K; ++i) acc = fma(Load::at(m.w, base + i), xr[i], acc);
    }
    return acc;
  }
};

// --- MLX affine quantization: w = scale * q + bias per group of G columns -----------------

struct ScaleF32 {
  static float at(device const uchar* s, uint i) { return ((device const float*)s)[i]; }
};
struct ScaleF16 {
  static float at(device const uchar* s, uint i) { return float(((device const half*)s)[i]); }
};
struct ScaleBF16 {
  static float at(device const uchar* s, uint i) {
    return as_type<float>(uint(((device const ushort*)s)[i]) << 16);
  }
};

// 4-bit codes, eight to a little-endian 32-bit word, code j of a word at bits 4j. The lane
// reads its 16 codes as four 16-bit words and multiplies masked nibbles in place: x values are
// pre-divided by 1, 16, 256, 4096 (exact: powers of two), so no shifts are needed. A group
// then costs scale * acc + bias * sum(x). G is a multiple of 32, so a block never crosses one.
template <uint G, class Scale>
struct Q4Format {
  static float prepare_x(device const float* x, uint k0, uint K, thread float* xr) {
    const float sum = load_x_block(x, k0, K, xr);
    for (uint i = 0; i < kBlock; i += 4) {
      xr[i + 1] = xr[i + 1] / 16.0f;
      xr[i + 2] = xr[i + 2] / 256.0f;
      xr[i + 3] = xr[i + 3] / 4096.0f;
    }
    return sum;
  }
  static float block_dot(thread const MatrixRef& m, uint row, uint k0, uint K,
                         thread const float* xr, float xsum) {
    (void)K;
    device const ushort* q = (device const ushort*)m.w + (ulong(row) * m.cols + k0) / 4;
    float acc = 0.0f;
    for (uint i = 0; i < kBlock / 4; ++i) {
      const uint w = q[i];
      acc = fma(xr[4 * i + 0], float(w & 0x000fu), acc);
      acc = fma(xr[4 * i + 1], float(w & 0x00f0u), acc);
      acc = fma(xr[4 * i + 2], float(w & 0x0f00u), acc);
      acc = fma(xr[4 * i + 3], float(w & 0xf000u), acc);
    }
    const uint g = row * (m.cols / G) + k0 / G;
    return fma(Scale::at(m.s, g), acc, Scale::at(m.b, g) * xsum);
  }
};

// 8-bit codes, four to a word (byte j = code j).
template <uint G, class Scale>
struct Q8Format : PlainX {
  static float block_dot(thread const MatrixRef& m, uint row, uint k0, uint K,
                         thread const float* xr, float xsum) {
    (void)K;
    device const uchar* q = m.w + ulong(row) * m.cols + k0;
    float acc = 0.0f;
    for (uint i = 0; i < kBlock; ++i) acc = fma(xr[i], float(q[i]), acc);
    const uint g = row * (m.cols / G) + k0 / G;
    return fma(Scale::at(m.s, g), acc, Scale::at(m.b, g) * xsum);
  }
};

// --- mxfp4: w = FP4(q) * 2^(e - 127) per group of 32 columns ---------------------------------

// An E2M1 code's value without its sign (bit 3): 0, 0.5, 1, 1.5, 2, 3, 4, 6. Computed, not
// looked up, so no constant table is needed: exponent bits e = (c >> 1) & 3, mantissa m = c & 1.
inline float fp4_value(uint c) {
  const uint e = (c >> 1) & 3u, m = c & 1u;
  const float mag = e == 0 ? 0.5f * float(m) : float(2u + m) * float(1u << e) * 0.25f;
  return (c & 8u) ? -mag : mag;
}

// The E8M0 exponent as MLX decodes it: through bfloat16's exponent bits (0 is 2^-127, 255 inf).
inline float e8m0_value(uint e) { return as_type<float>((e == 0 ? 0x40u : e << 7) << 16); }

// Codes packed like q4; the lane's 16 codes are two 32-bit words, one group's scale (G = 32:
// a block never crosses a group). Each product FP4 * x is exact up to x's rounding, and the
// group's sum is scaled once, as MLX's fp_qmm does.
struct Mxfp4Format : PlainX {
  static float block_dot(thread const MatrixRef& m, uint row, uint k0, uint K,
                         thread const float* xr, float xsum) {
    (void)K;
    (void)xsum;
    device const uint* q = (device const uint*)m.w + (ulong(row) * m.cols + k0) / 8;
    float acc = 0.0f;
    for (uint i = 0; i < kBlock; ++i)
      acc = fma(xr[i], fp4_value((q[i / 8] >> (4 * (i % 8))) & 15u), acc);
    const uint g = row * (m.cols / 32) + k0 / 32;
    return e8m0_value(uint(m.s[g])) * acc;
  }
};

// Every format the pack defines, as (name suffix, type): the kernels instantiate through this
// list so a format cannot be forgotten in one kernel and present in another.
#define STRATA_FOR_EACH_QUANT_GROUP(X, bits, Fmt, G) \
  X("q" #bits "_g" #G "_sf32", Fmt<G, ScaleF32>)     \
  X("q" #bits "_g" #G "_sf16", Fmt<G, ScaleF16>)     \
  X("q" #bits "_g" #G "_sbf16", Fmt<G, ScaleBF16>)

#define STRATA_FOR_EACH_FORMAT(X)                          \
  X("f32", FloatFormat<LoadF32>)                           \
  X("f16", FloatFormat<LoadF16>)                           \
  X("bf16", FloatFormat<LoadBF16>)                         \
  STRATA_FOR_EACH_QUANT_GROUP(X, 4, Q4Format, 32)          \
  STRATA_FOR_EACH_QUANT_GROUP(X, 4, Q4Format, 64)          \
  STRATA_FOR_EACH_QUANT_GROUP(X, 4, Q4Format, 128)         \
  STRATA_FOR_EACH_QUANT_GROUP(X, 8, Q8Format, 32)          \
  STRATA_FOR_EACH_QUANT_GROUP(X, 8, Q8Format, 64)          \
  STRATA_FOR_EACH_QUANT_GROUP(X, 8, Q8Format, 128)         \
  X("mxfp4", Mxfp4Format)
