// Device dequantization: 8 consecutive columns of one row of an expert matrix as float32, for
// every pack format (docs/pack-format.md; the same values as pack/weights.cpp, exactly: every
// conversion is exact and the affine w = s * q + b is one rounded multiply and one rounded add,
// never fused, as on the CPU).
#pragma once

#include <cstdint>

#include "device_types.h"

namespace strata::cuda {

// The hardware's exact half -> float conversion (subnormals included), without cuda_fp16.h,
// whose CCCL dependency PyPI's nvcc wheel lacks.
__device__ __forceinline__ float half_bits(std::uint16_t h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ float bf16_bits(std::uint16_t b) {
  return __uint_as_float(std::uint32_t(b) << 16);
}
__device__ __forceinline__ std::uint16_t load_u16(const unsigned char* p) {
  // Every 16-bit element is 2-byte aligned (tensors sit at 256-byte offsets in a record).
  return *reinterpret_cast<const std::uint16_t*>(p);
}
__device__ __forceinline__ std::uint32_t load_u32(const unsigned char* p) {
  // Records put every tensor on an aligned offset; words are read as words.
  return *reinterpret_cast<const std::uint32_t*>(p);
}

// Element i of a scale-format array: 0 f32, 1 f16, 2 bf16 (an exact widening).
__device__ __forceinline__ float scale_at(const unsigned char* p, std::uint32_t i,
                                          std::uint32_t fmt) {
  if (fmt == 0) return __uint_as_float(load_u32(p + 4 * std::size_t(i)));
  const std::uint16_t h = load_u16(p + 2 * std::size_t(i));
  return fmt == 1 ? half_bits(h) : bf16_bits(h);
}

// MLX's E8M0 decode: the exponent in a bfloat16's exponent bits (0 -> 2^-127, 255 -> inf).
__device__ __forceinline__ float e8m0(std::uint8_t e) {
  return bf16_bits(e == 0 ? std::uint16_t(0x0040) : std::uint16_t(std::uint16_t(e) << 7));
}

// float(q) for an integer q < 2^23, without the conversion instruction (a quarter-rate one, which
// bounds the q4 decode kernels): 2^23 + q is exact in a float's mantissa, and so is the
// subtraction. The same value as float(q), bit for bit.
__device__ __forceinline__ float small_uint_float(std::uint32_t q) {
  return __fsub_rn(__uint_as_float(0x4B000000u | q), 8388608.0f);
}

__device__ __forceinline__ float fp4(std::uint32_t code) {
  // E2M1 as float bits (no table: a dynamically indexed array would sit in local memory):
  // exponent field e, mantissa bit m; e = 0 is 0 or 0.5 (the subnormal), else 2^(e-1) (1 + m/2).
  const std::uint32_t e = (code >> 1) & 3u, m = code & 1u;
  const std::uint32_t mag = e ? ((e + 126u) << 23) | (m << 22) : (m ? 0x3F000000u : 0u);
  return __uint_as_float(mag | ((code & 8u) << 28));  // the sign: -0.0 for code 8, as before
}

// The Linear bias of output r (0 without biases).
__device__ __forceinline__ float bias_at(const DevLayout& L, const DevMatrix& m,
                                         const unsigned char* rec, std::uint32_t r) {
  if (m.bias == kNoTensor) return 0.0f;
  return scale_at(rec + m.bias, r, L.bias_format - 1);
}

// Columns [c0, c0 + 8) of row r (c0 a multiple of 8; columns past `cols` read as 0, float
// formats only: quantized rows are whole groups). F and S: the weight format and the affine
// scales' format when the caller fixes them at compile time (the decode kernels, one instance
// each, so that no format branch sits between a loop's loads), -1 to read them from L.
template <int F = -1, int S = -1>
__device__ __forceinline__ void load8(const DevLayout& L, const DevMatrix& m,
                                      const unsigned char* rec, std::uint32_t r, std::uint32_t c0,
                                      float v[8]) {
  const std::uint32_t cols = m.cols;
  const unsigned char* w = rec + m.weight;
  const std::uint32_t format = F < 0 ? L.format : std::uint32_t(F);
  switch (format) {
    case 0: {
      const unsigned char* p = w + (std::size_t(r) * cols + c0) * 4;
#pragma unroll
      for (int i = 0; i < 8; ++i)
        v[i] = c0 + i < cols ? __uint_as_float(load_u32(p + 4 * i)) : 0.0f;
      return;
    }
    case 1:
    case 2: {
      const unsigned char* p = w + (std::size_t(r) * cols + c0) * 2;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const std::uint16_t h = c0 + i < cols ? load_u16(p + 2 * i) : std::uint16_t(0);
        v[i] = format == 1 ? half_bits(h) : bf16_bits(h);
      }
      return;
    }
    case 3:
    case 4: {
      const std::uint32_t groups = cols / L.group_size;
      const std::uint32_t g = c0 / L.group_size;
      const std::uint32_t sf = S < 0 ? L.scale_format : std::uint32_t(S);
      const float s = scale_at(rec + m.scales, r * groups + g, sf);
      const float b = scale_at(rec + m.biases, r * groups + g, sf);
      if (format == 3) {
        const std::uint32_t word = load_u32(w + (std::size_t(r) * (cols / 8) + c0 / 8) * 4);
#pragma unroll
        for (int i = 0; i < 8; ++i)
          v[i] = __fadd_rn(__fmul_rn(s, small_uint_float((word >> (4 * i)) & 15u)), b);
      } else {
        const unsigned char* p = w + (std::size_t(r) * (cols / 4) + c0 / 4) * 4;
        const std::uint32_t w0 = load_u32(p), w1 = load_u32(p + 4);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          v[i] = __fadd_rn(__fmul_rn(s, small_uint_float((w0 >> (8 * i)) & 255u)), b);
          v[4 + i] = __fadd_rn(__fmul_rn(s, small_uint_float((w1 >> (8 * i)) & 255u)), b);
        }
      }
      return;
    }
    default: {  // 5: mxfp4, codes packed as q4, one e8m0 scale per group
      const std::uint32_t groups = cols / L.group_size;
      const float s = e8m0(rec[m.scales + std::size_t(r) * groups + c0 / L.group_size]);
      const std::uint32_t word = load_u32(w + (std::size_t(r) * (cols / 8) + c0 / 8) * 4);
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = __fmul_rn(fp4((word >> (4 * i)) & 15u), s);
      return;
    }
  }
}

}  // namespace strata::cuda
