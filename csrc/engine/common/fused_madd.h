// acc + a * b on eight floats, fused wherever the target has a fused multiply-add: the one
// rounding rule every float path of the CPU backend takes (the kernels' dot products and the
// q4/q8 dequantization s * q + b alike), and the one the CUDA and Metal kernels match (I11).
//
// It is stated, not left to the compiler: GCC contracts `acc + a * b` into an FMA only where
// its optimizer runs, so an -O0 or -O1 build of the same target would round twice in one file
// and once in another. A target without FMA rounds twice everywhere.
#pragma once

#include <cstring>

#if defined(__FMA__)
#include <immintrin.h>
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif

#if defined(__GNUC__) && !defined(__clang__)
// The vector passes by value to an inline helper: no ABI is involved, so GCC's note that a
// target without AVX passes it differently does not apply. GCC reports it at the end of the
// including file, so it is off from here on (the kernels' file turns it off too).
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

namespace strata {

typedef float f8v __attribute__((vector_size(32)));

inline f8v fused_madd8(f8v acc, f8v a, f8v b) {
#if defined(__FMA__)
  return f8v(_mm256_fmadd_ps(__m256(a), __m256(b), __m256(acc)));
#elif defined(__aarch64__)
  float f[3][8];
  std::memcpy(f[0], &acc, 32);
  std::memcpy(f[1], &a, 32);
  std::memcpy(f[2], &b, 32);
  vst1q_f32(f[0], vfmaq_f32(vld1q_f32(f[0]), vld1q_f32(f[1]), vld1q_f32(f[2])));
  vst1q_f32(f[0] + 4, vfmaq_f32(vld1q_f32(f[0] + 4), vld1q_f32(f[1] + 4), vld1q_f32(f[2] + 4)));
  f8v r;
  std::memcpy(&r, f[0], 32);
  return r;
#else
  return acc + a * b;
#endif
}

}  // namespace strata
