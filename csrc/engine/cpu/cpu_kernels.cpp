#include "cpu/cpu_kernels.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif

#include "common/fused_madd.h"
#include "cpu/mlx_kernels.h"
#include "residency/slot.h"
#include "residency/smap.h"
#include "pack/weights.h"



namespace strata::cpu {
namespace {

typedef float v8 __attribute__((vector_size(32)));
typedef float v16 __attribute__((vector_size(64)));

#if defined(__GNUC__) && !defined(__clang__)
// Vectors passed by value to this file's internal inline helpers: no ABI is involved, so GCC's
// note that a target without AVX passes them differently does not apply (GCC reports it at the
// end of the file, so it stays off for the whole file).
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

inline v16 madd16(v16 acc, v16 a, v16 b) {
#if defined(__AVX512F__)
  return v16(_mm512_fmadd_ps(__m512(a), __m512(b), __m512(acc)));
#else
  v8 a0, a1, b0, b1, c0, c1;
  std::memcpy(&a0, &a, 32);
  std::memcpy(&a1, reinterpret_cast<const char*>(&a) + 32, 32);
  std::memcpy(&b0, &b, 32);
  std::memcpy(&b1, reinterpret_cast<const char*>(&b) + 32, 32);
  std::memcpy(&c0, &acc, 32);
  std::memcpy(&c1, reinterpret_cast<const char*>(&acc) + 32, 32);
  c0 = fused_madd8(c0, a0, b0);
  c1 = fused_madd8(c1, a1, b1);
  v16 r;
  std::memcpy(&r, &c0, 32);
  std::memcpy(reinterpret_cast<char*>(&r) + 32, &c1, 32);
  return r;
#endif
}

// Output rows dequantized together: each tile row is read by every entry while it is in L1.
constexpr std::uint32_t kBlockRows = 4;
// Entries dotted together with a row block: kBlockRows x kBlockEntries accumulators stay in
// registers (32 vector registers with AVX-512, 16 with AVX2 or NEON's halves).
#if defined(__AVX512F__)
constexpr std::uint32_t kBlockEntries = 4;
#else
constexpr std::uint32_t kBlockEntries = 2;
#endif

// dot's value from its 16 lanes when n is a multiple of 16: lanes 0-7 are its acc0, 8-15 its
// acc1, folded in its order; its tail is +0 and is still added (it turns a -0 into +0).
inline float fold16(v16 acc) {
  float s[8];
  for (int l = 0; l < 8; ++l) s[l] = acc[l] + acc[l + 8];
  return ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7])) + 0.0f;
}

#if defined(__AVX512F__)
// out[q * n_x + e] = fold16(acc[q][e]): the fold of both matrix paths, the tile's and the fused.
template <std::uint32_t NR, std::uint32_t NE>
inline void fold_out(const __m512 (&acc)[NR][NE], std::uint32_t n_x, float* out) {
  for (std::uint32_t q = 0; q < NR; ++q)
    for (std::uint32_t e = 0; e < NE; ++e) {
      v16 a;
      std::memcpy(&a, &acc[q][e], 64);
      out[std::size_t(q) * n_x + e] = fold16(a);
    }
}
#endif

// out[q * n_x + e] = dot(tile row q, xs[e], cols) for NR tile rows and NE entries starting at e0:
// each (row, entry) is one accumulator with dot's lanes, so blocking changes no bit.
template <std::uint32_t NR, std::uint32_t NE>
inline void dots_rows_entries(const float* tile, const float* const* xs, std::uint32_t e0,
                              std::uint32_t n_x, std::uint32_t cols, float* out) {
#if defined(__AVX512F__)
  // The same as below in intrinsics: GCC keeps __m512 arrays in registers, not vector-extension
  // arrays filled by memcpy.
  __m512 acc[NR][NE];
#pragma GCC unroll 16
  for (std::uint32_t q = 0; q < NR; ++q)
#pragma GCC unroll 16
    for (std::uint32_t e = 0; e < NE; ++e) acc[q][e] = _mm512_setzero_ps();
  const float* x[NE];
#pragma GCC unroll 16
  for (std::uint32_t e = 0; e < NE; ++e) x[e] = xs[e0 + e];
  for (std::uint32_t c = 0; c + 16 <= cols; c += 16) {
    __m512 w[NR], xv[NE];
#pragma GCC unroll 16
    for (std::uint32_t q = 0; q < NR; ++q) w[q] = _mm512_loadu_ps(tile + std::size_t(q) * cols + c);
#pragma GCC unroll 16
    for (std::uint32_t e = 0; e < NE; ++e) xv[e] = _mm512_loadu_ps(x[e] + c);
#pragma GCC unroll 16
    for (std::uint32_t q = 0; q < NR; ++q)
#pragma GCC unroll 16
      for (std::uint32_t e = 0; e < NE; ++e) acc[q][e] = _mm512_fmadd_ps(w[q], xv[e], acc[q][e]);
  }
  fold_out(acc, n_x, out + e0);
#else
  v16 acc[NR][NE] = {};
  for (std::uint32_t c = 0; c + 16 <= cols; c += 16) {
    v16 w[NR], x[NE];
    for (std::uint32_t q = 0; q < NR; ++q) std::memcpy(&w[q], tile + std::size_t(q) * cols + c, 64);
    for (std::uint32_t e = 0; e < NE; ++e) std::memcpy(&x[e], xs[e0 + e] + c, 64);
    for (std::uint32_t q = 0; q < NR; ++q)
      for (std::uint32_t e = 0; e < NE; ++e) acc[q][e] = madd16(acc[q][e], w[q], x[e]);
  }
  for (std::uint32_t q = 0; q < NR; ++q)
    for (std::uint32_t e = 0; e < NE; ++e) out[std::size_t(q) * n_x + e0 + e] = fold16(acc[q][e]);
#endif
}

template <std::uint32_t NR>
void block_dots(const float* tile, const float* const* xs, std::uint32_t n_x, std::uint32_t cols,
                float* out) {
  std::uint32_t e = 0;
  for (; e + kBlockEntries <= n_x; e += kBlockEntries)
    dots_rows_entries<NR, kBlockEntries>(tile, xs, e, n_x, cols, out);
  for (; e < n_x; ++e) dots_rows_entries<NR, 1>(tile, xs, e, n_x, cols, out);
}

// Row r of m into out[cols]: MatrixView::row's values bit for bit (tests/cpp/test_cpu_kernels).
// With AVX-512 the 4-bit formats look their values up in a 16-entry table per group (the
// table's entries are computed exactly as row computes each element), the 8- and 16-bit ones
// widen 16 at a time; other targets and formats use row itself.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
// GCC 12's AVX-512 widening intrinsics start from _mm512_undefined_*, which -Wmaybe-uninitialized
// reports at every inlined use (a false positive).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#if defined(__AVX512F__)
// How far ahead of the row being dequantized its weights are asked for: a block's rows are
// contiguous, and the hardware prefetcher alone left the unpacking waiting on memory.
constexpr std::size_t kPrefetchBytes = 2048;

// Elements [i0, i0 + n) of a scale-format array (0 f32, 1 f16, 2 bf16) as float32 into out,
// scale_value's values: 16 at a time, and from an f16 block holding an infinity or NaN (whose
// payload the hardware conversion could change) on element by element through scale_value.
inline void widen_scales(const unsigned char* p, std::uint32_t fmt, std::size_t i0,
                         std::uint32_t n, float* out) {
  std::uint32_t i = 0;
  if (fmt == 0) {
    std::memcpy(out, p + 4 * i0, std::size_t(n) * 4);
    return;
  }
  for (; i < n; i += 16) {
    // Whole blocks straight from the array; the last partial one (all of a row of fewer than 16
    // groups, a down matrix's) through a zero-padded copy, so it widens in one step too.
    const std::uint32_t len = std::min(16u, n - i);
    alignas(32) std::uint16_t part[16] = {};
    const unsigned char* src = p + 2 * (i0 + i);
    if (len < 16) {
      std::memcpy(part, src, std::size_t(len) * 2);
      src = reinterpret_cast<const unsigned char*>(part);
    }
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    __m512 wide;
    if (fmt == 2) {
      wide = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      const __m256i e = _mm256_and_si256(h, _mm256_set1_epi16(0x7C00));
      if (_mm256_movemask_epi8(_mm256_cmpeq_epi16(e, _mm256_set1_epi16(0x7C00))) != 0) break;
      wide = _mm512_cvtph_ps(h);  // exact for finite values, subnormals too
    }
    if (len == 16) {
      _mm512_storeu_ps(out + i, wide);
    } else {
      alignas(64) float tail[16];
      _mm512_store_ps(tail, wide);
      std::memcpy(out + i, tail, std::size_t(len) * 4);
    }
  }
  for (; i < n; ++i) out[i] = scale_value(p, std::uint32_t(i0 + i), fmt);
}

// The 16 nibbles at p (8 bytes: columns 2j in byte j's low nibble, 2j + 1 in its high one) as
// permute indices in column order: dword l's low 4 bits are column l's code (the permute reads
// only those, so the rest needs no mask).
inline __m512i nibble_index(const unsigned char* p) {
  std::uint64_t v;
  std::memcpy(&v, p, 8);
#if defined(__AVX512VBMI__)
  // Every qword holds the 8 bytes; qword k's dwords take the bytes at bits 8k and 8k + 4.
  const __m512i shifts = _mm512_setr_epi64(
      0x0000000400000000ll, 0x0000000C00000008ll, 0x0000001400000010ll, 0x0000001C00000018ll,
      0x0000002400000020ll, 0x0000002C00000028ll, 0x0000003400000030ll, 0x0000003C00000038ll);
  return _mm512_multishift_epi64_epi8(shifts, _mm512_set1_epi64(std::int64_t(v)));
#else
  // Qword k holds byte k; shifted by 28 its high nibble lands in dword 2k + 1's low bits.
  const __m512i t = _mm512_cvtepu8_epi64(_mm_cvtsi64_si128(std::int64_t(v)));
  return _mm512_or_si512(t, _mm512_slli_epi64(t, 28));
#endif
}
#endif

inline void dequant_row(const MatrixView& m, std::uint32_t r, float* out) {
#if defined(__AVX512F__)
  const std::uint32_t cols = m.cols, gs = m.group_size;
  const std::uint32_t groups = gs ? cols / gs : 0;
  constexpr std::uint32_t kMaxGroups = 1024;  // the row's scales on the stack
  const bool nibbles = m.format == WeightFormat::Q4 || m.format == WeightFormat::Mxfp4;
  if (nibbles && gs % 32 == 0 && groups <= kMaxGroups) {
    const unsigned char* p = m.weight + std::size_t(r) * (cols / 2);
    alignas(64) float sc[kMaxGroups], bi[kMaxGroups];
    if (m.format == WeightFormat::Q4) {
      widen_scales(m.scales, m.scale_format, std::size_t(r) * groups, groups, sc);
      widen_scales(m.biases, m.scale_format, std::size_t(r) * groups, groups, bi);
    } else {
      for (std::uint32_t g = 0; g < groups; ++g)
        sc[g] = e8m0_to_float(m.scales[std::size_t(r) * groups + g]);
    }
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 fp4 = _mm512_loadu_ps(kFp4Values);
    for (std::uint32_t g = 0; g < groups; ++g) {
      // Q4: row's s * q + b, which the compiler contracts to one FMA on this target.
      // Mxfp4: FP4(q) * 2^(e - 127), exact, as in row.
      const __m512 lut = m.format == WeightFormat::Q4
                             ? _mm512_fmadd_ps(_mm512_set1_ps(sc[g]), iota, _mm512_set1_ps(bi[g]))
                             : _mm512_mul_ps(fp4, _mm512_set1_ps(sc[g]));
      for (std::uint32_t i = 0; i < gs / 32; ++i, p += 16, out += 32) {
        _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T0);
        _mm512_storeu_ps(out, _mm512_permutexvar_ps(nibble_index(p), lut));
        _mm512_storeu_ps(out + 16, _mm512_permutexvar_ps(nibble_index(p + 8), lut));
      }
    }
    return;
  }
  if (m.format == WeightFormat::Q8 && gs % 16 == 0 && groups <= kMaxGroups) {
    const unsigned char* p = m.weight + std::size_t(r) * cols;
    alignas(64) float sc[kMaxGroups], bi[kMaxGroups];
    widen_scales(m.scales, m.scale_format, std::size_t(r) * groups, groups, sc);
    widen_scales(m.biases, m.scale_format, std::size_t(r) * groups, groups, bi);
    for (std::uint32_t g = 0; g < groups; ++g) {
      const __m512 s = _mm512_set1_ps(sc[g]), bias = _mm512_set1_ps(bi[g]);
      for (std::uint32_t i = 0; i < gs / 16; ++i, p += 16, out += 16) {
        _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T0);
        const __m512i q =
            _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        _mm512_storeu_ps(out, _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(q), bias));
      }
    }
    return;
  }
  if (m.format == WeightFormat::BF16) {
    const unsigned char* p = m.weight + std::size_t(r) * cols * 2;
    for (std::uint32_t c = 0; c < cols; c += 16) {
      _mm_prefetch(reinterpret_cast<const char*>(p + 2 * std::size_t(c)) + kPrefetchBytes,
                   _MM_HINT_T0);
      const __m512i h = _mm512_cvtepu16_epi32(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2 * std::size_t(c))));
      _mm512_storeu_si512(out + c, _mm512_slli_epi32(h, 16));
    }
    return;
  }
#endif
  m.row(r, out);
}
#if defined(__AVX512F__)
// The fused path: a block of rows is dequantized 16 columns at a time in registers and each
// vector goes straight into its (row, entry) accumulators, with no tile in between. The
// accumulators are the tile path's (lane l takes columns l, l + 16, ... in order, by FMA, then
// fold16) and each 16-column vector holds dequant_row's values, so the bits are the same; what
// goes is the tile's store and reload, and the dequantization shares the FMA ports with the dots
// instead of waiting for them.

// Rows dequantized together on the fused path: independent FMA chains, and as many weight
// streams in flight. With more entries fewer rows keep the accumulators in registers.
template <std::uint32_t NE>
constexpr std::uint32_t kFusedRows = NE <= 4 ? 4 : 2;
// Entries the fused path takes in one pass over the rows; more go through the tile, which
// dequantizes a row once for all of them.
constexpr std::uint32_t kFusedEntries = 8;
// Scales of a row block widened on the stack (rows x groups); a wider matrix takes the tile.
constexpr std::uint32_t kFusedScales = 1024;

// One row block (NR rows from r, NE entries) of the fused path; `load(q, c)` gives columns
// [c, c + 16) of block row q and `group(g)` is called before group g's first column. Each row's
// weights are asked for one block ahead of where the block reads them, spread over the block:
// the rows of a range are contiguous, so this streams the next block while this one computes.
template <std::uint32_t NR, std::uint32_t NE, class Group, class Load>
inline void fused_block(const float* const* xs, std::uint32_t cols, std::uint32_t gs,
                        const unsigned char* base, std::size_t row_bytes, std::uint32_t n_x,
                        float* out, Group group, Load load) {
  __m512 acc[NR][NE];
#pragma GCC unroll 16
  for (std::uint32_t q = 0; q < NR; ++q)
#pragma GCC unroll 16
    for (std::uint32_t e = 0; e < NE; ++e) acc[q][e] = _mm512_setzero_ps();
  const float* x[NE];
#pragma GCC unroll 16
  for (std::uint32_t e = 0; e < NE; ++e) x[e] = xs[e];
  // Bytes of a row per column, times 16: the prefetch keeps one line per row per 64 bytes.
  const std::size_t step_bytes = row_bytes / (cols / 16);
  const std::size_t ahead = NR * row_bytes;
  for (std::uint32_t g0 = 0, g = 0; g0 < cols; g0 += gs, ++g) {
    group(g);
    for (std::uint32_t c = g0; c < g0 + gs; c += 16) {
      const std::size_t off = std::size_t(c / 16) * step_bytes;
      if (off % 64 < step_bytes)
#pragma GCC unroll 16
        for (std::uint32_t q = 0; q < NR; ++q)
          _mm_prefetch(reinterpret_cast<const char*>(base + q * row_bytes + off + ahead),
                       _MM_HINT_T0);
      __m512 xv[NE];
#pragma GCC unroll 16
      for (std::uint32_t e = 0; e < NE; ++e) xv[e] = _mm512_loadu_ps(x[e] + c);
#pragma GCC unroll 16
      for (std::uint32_t q = 0; q < NR; ++q) {
        const __m512 w = load(q, c);
#pragma GCC unroll 16
        for (std::uint32_t e = 0; e < NE; ++e) acc[q][e] = _mm512_fmadd_ps(w, xv[e], acc[q][e]);
      }
    }
  }
  fold_out(acc, n_x, out);
}

// Rows [r, r + NR) of m, entries xs[0, NE): out[q * n_x + e]. `sc`, `bi`: the block's scales and
// biases widened (row q's group g at q * groups + g).
template <std::uint32_t NR, std::uint32_t NE>
void fused_rows(const MatrixView& m, std::uint32_t r, const float* const* xs, std::uint32_t n_x,
                const float* sc, const float* bi, float* out) {
  const std::uint32_t cols = m.cols, gs = m.group_size;
  const std::uint32_t groups = gs ? cols / gs : 0;
  switch (m.format) {
    case WeightFormat::Q4:
    case WeightFormat::Mxfp4: {
      const std::size_t row_bytes = cols / 2;
      const unsigned char* base = m.weight + std::size_t(r) * row_bytes;
      const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      const __m512 fp4 = _mm512_loadu_ps(kFp4Values);
      __m512 lut[NR];
      auto load = [&](std::uint32_t q, std::uint32_t c) {
        return _mm512_permutexvar_ps(nibble_index(base + q * row_bytes + c / 2), lut[q]);
      };
      // dequant_row's tables: Q4 s * q + b as one FMA, Mxfp4 FP4(q) * 2^(e - 127).
      if (m.format == WeightFormat::Q4)
        fused_block<NR, NE>(xs, cols, gs, base, row_bytes, n_x, out, [&](std::uint32_t g) {
#pragma GCC unroll 16
          for (std::uint32_t q = 0; q < NR; ++q)
            lut[q] = _mm512_fmadd_ps(_mm512_set1_ps(sc[q * groups + g]), iota,
                                     _mm512_set1_ps(bi[q * groups + g]));
        }, load);
      else
        fused_block<NR, NE>(xs, cols, gs, base, row_bytes, n_x, out, [&](std::uint32_t g) {
#pragma GCC unroll 16
          for (std::uint32_t q = 0; q < NR; ++q)
            lut[q] = _mm512_mul_ps(fp4, _mm512_set1_ps(sc[q * groups + g]));
        }, load);
      return;
    }
    case WeightFormat::Q8: {
      const std::size_t row_bytes = cols;
      const unsigned char* base = m.weight + std::size_t(r) * row_bytes;
      __m512 s[NR], b[NR];
      fused_block<NR, NE>(
          xs, cols, gs, base, row_bytes, n_x, out,
          [&](std::uint32_t g) {
#pragma GCC unroll 16
            for (std::uint32_t q = 0; q < NR; ++q) {
              s[q] = _mm512_set1_ps(sc[q * groups + g]);
              b[q] = _mm512_set1_ps(bi[q * groups + g]);
            }
          },
          [&](std::uint32_t q, std::uint32_t c) {
            const __m512i v = _mm512_cvtepu8_epi32(
                _mm_loadu_si128(reinterpret_cast<const __m128i*>(base + q * row_bytes + c)));
            return _mm512_fmadd_ps(s[q], _mm512_cvtepi32_ps(v), b[q]);
          });
      return;
    }
    default: {  // BF16: the top half of a float32
      const std::size_t row_bytes = std::size_t(cols) * 2;
      const unsigned char* base = m.weight + std::size_t(r) * row_bytes;
      fused_block<NR, NE>(
          xs, cols, cols, base, row_bytes, n_x, out, [](std::uint32_t) {},
          [&](std::uint32_t q, std::uint32_t c) {
            const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                reinterpret_cast<const __m256i*>(base + q * row_bytes + 2 * std::size_t(c))));
            return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
          });
      return;
    }
  }
}

// Whether matrix_dots takes the fused path for m and n_x entries (the formats above, with
// groups of whole 16-column steps whose scales fit the stack; cols % 16 == 0 is checked first).
inline bool fused_fits(const MatrixView& m, std::uint32_t n_x) {
  if (n_x == 0 || n_x > kFusedEntries) return false;
  switch (m.format) {
    case WeightFormat::BF16: return true;
    case WeightFormat::Q4:
    case WeightFormat::Mxfp4:
    case WeightFormat::Q8:
      return m.group_size != 0 && m.group_size % 16 == 0 && m.cols % m.group_size == 0 &&
             kFusedRows<1> * (m.cols / m.group_size) <= kFusedScales;
    default: return false;
  }
}

// Rows [r0, r1) and all n_x entries on the fused path: blocks of kFusedRows<NE>, then single
// rows for the rest.
template <std::uint32_t NE>
void fused_dots(const MatrixView& m, std::uint32_t r0, std::uint32_t r1, const float* const* xs,
                float* out) {
  constexpr std::uint32_t NR = kFusedRows<NE>;
  const std::uint32_t groups = m.group_size ? m.cols / m.group_size : 0;
  alignas(64) float sc[kFusedScales], bi[kFusedScales];
  auto widen = [&](std::uint32_t r, std::uint32_t n) {
    if (m.format == WeightFormat::Q4 || m.format == WeightFormat::Q8) {
      widen_scales(m.scales, m.scale_format, std::size_t(r) * groups, n * groups, sc);
      widen_scales(m.biases, m.scale_format, std::size_t(r) * groups, n * groups, bi);
    } else if (m.format == WeightFormat::Mxfp4) {
      for (std::uint32_t i = 0; i < n * groups; ++i)
        sc[i] = e8m0_to_float(m.scales[std::size_t(r) * groups + i]);
    }
  };
  std::uint32_t r = r0;
  for (; r + NR <= r1; r += NR) {
    widen(r, NR);
    fused_rows<NR, NE>(m, r, xs, NE, sc, bi, out + std::size_t(r - r0) * NE);
  }
  for (; r < r1; ++r) {
    widen(r, 1);
    fused_rows<1, NE>(m, r, xs, NE, sc, bi, out + std::size_t(r - r0) * NE);
  }
}
#endif
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

inline float silu(float z) { return z / (1.0f + std::exp(-z)); }

// The expert activation of one element; every path (decode passes, prompt waves, routed calls)
// calls this one function, so they stay bitwise identical (I11).
// Each kind in the operation order of the transformers module it stands for, in float32.
inline float activate(const ExpertView& ev, float g, float u) {
  switch (ev.activation) {
    case Activation::SwiGLU:
      return silu(g) * u;
    case Activation::SwigluOai: {
      // gpt-oss: the gate clipped from above only, the linear part both ways and shifted by one.
      const float lim = ev.act_limit;
      const float gc = std::min(g, lim);
      const float uc = std::min(std::max(u, -lim), lim);
      return (uc + 1.0f) * (gc / (1.0f + std::exp(-ev.act_alpha * gc)));
    }
    case Activation::SwigluClamp: {
      // deepseek_v4 / hy_v4 / glm5_next: gpt-oss's clamps around a plain SwiGLU.
      const float lim = ev.act_limit;
      return silu(std::min(g, lim)) * std::min(std::max(u, -lim), lim);
    }
    case Activation::GegluTanh: {
      // torch's gelu(approximate="tanh"): 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))).
      constexpr float kBeta = 0.7978845608028654f, kKappa = 0.044715f;
      const float inner = kBeta * (g + kKappa * g * g * g);
      return 0.5f * g * (1.0f + std::tanh(inner)) * u;
    }
    case Activation::SwigluSoftcap: {
      // inkling2: the sigmoid sees the raw gate; softcaps bound the linear gate factor and up.
      const float gc = std::tanh(g / ev.act_alpha) * ev.act_alpha;
      const float uc = std::tanh(u / ev.act_limit) * ev.act_limit;
      return gc * (1.0f / (1.0f + std::exp(-g))) * uc;
    }
    case Activation::Relu2: {
      // Gateless experts: relu(up)^2 (g is unused).
      const float r = std::max(u, 0.0f);
      return r * r;
    }
  }
  return 0.0f;
}

// One expert's share of a pass: the (t * k + j) entries routed to it and its published slot.
struct Group {
  std::uint32_t expert;
  std::uint32_t slot;
  std::vector<std::uint32_t> entries;
};

// Groups the routed entries of `rows` tokens by expert, keeping those the predicate accepts.
// Slot resolution is the caller's: the plan's snapshot (resident) or smap now (missing).
template <class Accept>
std::vector<Group> group_entries(const DeviceBuffers& b, std::uint32_t rows, Accept accept) {
  const std::uint32_t k = b.layout->top_k;
  std::vector<std::int32_t> index(b.layout->n_experts, -1);
  std::vector<Group> groups;
  for (std::uint32_t i = 0; i < rows * k; ++i) {
    const std::uint32_t e = std::uint32_t(b.ids[i]);
    if (!accept(i, e)) continue;
    if (index[e] < 0) {
      index[e] = std::int32_t(groups.size());
      groups.push_back(Group{e, kAbsent, {}});
    }
    groups[std::size_t(index[e])].entries.push_back(i);
  }
  return groups;
}

// The per-call buffers of a matrix stage: the dequantized tile, the entries' inputs and one
// row block's dots.
struct DotScratch {
  std::vector<float> tile, gv, uv;
  std::vector<const float*> xs;
};

// h[i] = silu(gate x_t) * (up x_t) for every entry of the group, rows [r0, r1) of gate/up: each
// element is dot(gate row, x) + bias and dot(up row, x) + bias as matrix_dots computes them.
void gate_up_rows(const DeviceBuffers& b, const ExpertView& ev, const Group& g, std::uint32_t r0,
                  std::uint32_t r1, DotScratch& s) {
  const std::uint32_t H = b.layout->hidden, I = b.layout->moe_intermediate, k = b.layout->top_k;
  const std::uint32_t m = std::uint32_t(g.entries.size());
  s.xs.resize(m);
  for (std::uint32_t e = 0; e < m; ++e) s.xs[e] = b.x + std::size_t(g.entries[e] / k) * H;
  s.gv.resize(std::size_t(kBlockRows) * m);
  s.uv.resize(std::size_t(kBlockRows) * m);
  for (std::uint32_t r = r0; r < r1; r += kBlockRows) {
    const std::uint32_t n = std::min(kBlockRows, r1 - r);
    // Gateless experts skip the gate product (their activation reads up alone).
    if (ev.gated) matrix_dots(ev.gate, r, r + n, s.xs.data(), m, s.gv.data(), s.tile);
    else std::fill(s.gv.begin(), s.gv.end(), 0.0f);
    matrix_dots(ev.up, r, r + n, s.xs.data(), m, s.uv.data(), s.tile);
    for (std::uint32_t q = 0; q < n; ++q) {
      const float gb = ev.gated ? ev.gate.bias_at(r + q) : 0.0f, ub = ev.up.bias_at(r + q);
      for (std::uint32_t e = 0; e < m; ++e)
        b.h[std::size_t(g.entries[e]) * I + r + q] =
            activate(ev, s.gv[std::size_t(q) * m + e] + gb, s.uv[std::size_t(q) * m + e] + ub);
    }
  }
}

// y[i] = w_i * (down h_i), rows [r0, r1) of down.
void down_rows(const DeviceBuffers& b, const ExpertView& ev, const Group& g, std::uint32_t r0,
               std::uint32_t r1, DotScratch& s) {
  const std::uint32_t H = b.layout->hidden, I = b.layout->moe_intermediate;
  const std::uint32_t m = std::uint32_t(g.entries.size());
  s.xs.resize(m);
  for (std::uint32_t e = 0; e < m; ++e) s.xs[e] = b.h + std::size_t(g.entries[e]) * I;
  s.gv.resize(std::size_t(kBlockRows) * m);
  for (std::uint32_t r = r0; r < r1; r += kBlockRows) {
    const std::uint32_t n = std::min(kBlockRows, r1 - r);
    matrix_dots(ev.down, r, r + n, s.xs.data(), m, s.gv.data(), s.tile);
    for (std::uint32_t q = 0; q < n; ++q) {
      const float db = ev.down.bias_at(r + q);
      for (std::uint32_t e = 0; e < m; ++e) {
        const std::uint32_t i = g.entries[e];
        b.y[std::size_t(i) * H + r + q] = b.weights[i] * (s.gv[std::size_t(q) * m + e] + db);
      }
    }
  }
}

enum class Stage { GateUp, Down, Both };

// Below this many multiply-adds a parallel-for runs on the calling thread: waking the workers
// and waiting for them costs tens of microseconds (a futex round trip each way; more on a
// virtual machine), which is more than the work. Which thread computes an element never
// changes its bits (each element has one fixed sequence of operations), so this is speed only.
constexpr std::uint64_t kInlineMacs = std::uint64_t(1) << 18;

void parallel_for(const ParallelFor& pf, std::uint32_t n, std::uint64_t macs,
                  const std::function<void(std::uint32_t, std::uint32_t)>& fn) {
  if (macs < kInlineMacs) {
    if (n) fn(0, n);
    return;
  }
  pf(n, fn);
}

// One matrix stage over every group at once, parallel over (group, matrix row) pairs: one
// fork-join per stage, not one per expert (a decode batch's union is tens of experts). `rows`
// is the stage's output rows per expert; fn(group, r0, r1) computes rows [r0, r1) of a group.
template <class Fn>
void over_groups(const ParallelFor& pf, const std::vector<Group>& groups, std::uint32_t rows,
                 std::uint64_t macs_per_row_entry, Fn fn) {
  std::uint64_t macs = 0;
  for (const Group& g : groups) macs += (g.entries.size() + 1) * macs_per_row_entry * rows;
  const std::uint32_t n = std::uint32_t(groups.size()) * rows;
  parallel_for(pf, n, macs, [&](std::uint32_t i0, std::uint32_t i1) {
    while (i0 < i1) {  // the chunk, cut where it crosses from one group into the next
      const std::uint32_t g = i0 / rows, end = std::min(i1, (g + 1) * rows);
      fn(g, i0 - g * rows, end - g * rows);
      i0 = end;
    }
  });
}

// Runs a stage over groups (each output element has one writer). Both (prompt waves): every
// group's gate_up, then every group's down, which reads only its own entries' complete h.
void run_groups(const DeviceBuffers& b, std::uint32_t layer, const std::vector<Group>& groups,
                Stage stage, const ParallelFor& pf, Rounding rounding) {
  const std::uint32_t H = b.layout->hidden, I = b.layout->moe_intermediate;
  const bool as_mlx = rounding.arithmetic != Arithmetic::Float32;
  std::vector<ExpertView> views;
  views.reserve(groups.size());
  for (const Group& g : groups)
    views.push_back(
        expert_view(*b.layout, layer, b.arena + std::uint64_t(g.slot) * b.slot_bytes));
  if (stage != Stage::Down)
    over_groups(pf, groups, I, 2 * std::uint64_t(H),
                [&](std::uint32_t g, std::uint32_t r0, std::uint32_t r1) {
                  if (as_mlx) return mlx::gate_up_rows(b, views[g], groups[g].entries, r0, r1,
                                                       rounding);
                  DotScratch s;
                  gate_up_rows(b, views[g], groups[g], r0, r1, s);
                });
  if (stage != Stage::GateUp)
    over_groups(pf, groups, H, I, [&](std::uint32_t g, std::uint32_t r0, std::uint32_t r1) {
      if (as_mlx) return mlx::down_rows(b, views[g], groups[g].entries, r0, r1, rounding);
      DotScratch s;
      down_rows(b, views[g], groups[g], r0, r1, s);
    });
}

bool resolve_pass(const DeviceBuffers& b, std::uint32_t layer, std::uint32_t rows, Pass pass,
                  std::vector<Group>* out) {
  const std::uint32_t E = b.layout->n_experts;
  auto groups = group_entries(b, rows, [&](std::uint32_t i, std::uint32_t) {
    return (b.plan[i] != kAbsent) == (pass == Pass::Resident);
  });
  for (Group& g : groups) {
    // Resident: the slot the plan saw (I8 keeps it valid). Missing: published by now (release 2).
    g.slot = pass == Pass::Resident ? b.plan[g.entries.front()]
                                    : smap_load(b.smap, layer * E + g.expert);
    if (g.slot == kAbsent || g.slot >= b.n_slots) return false;
  }
  *out = std::move(groups);
  return true;
}

}  // namespace

float dot(const float* a, const float* b, std::uint32_t n) {
  // Two 8-float vector accumulators (GCC/Clang vector extensions: AVX on x86-64, NEON pairs on
  // arm64) hide the add latency; the lane fold and the scalar tail run in a fixed order, so the
  // result depends only on the inputs. The multiply-adds are fused wherever the target has
  // FMA (fused_madd8), as matrix_dots' are.
  v8 acc0 = {}, acc1 = {};
  std::size_t i = 0;
  const std::size_t len = n;
  for (; i + 16 <= len; i += 16) {
    v8 a0, a1, b0, b1;
    std::memcpy(&a0, a + i, 32);
    std::memcpy(&a1, a + i + 8, 32);
    std::memcpy(&b0, b + i, 32);
    std::memcpy(&b1, b + i + 8, 32);
    acc0 = fused_madd8(acc0, a0, b0);
    acc1 = fused_madd8(acc1, a1, b1);
  }
  v8 acc = acc0 + acc1;
  float tail = 0;
  for (; i < len; ++i) tail += a[i] * b[i];
  return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7])) + tail;
}

void matrix_dots(const MatrixView& m, std::uint32_t r0, std::uint32_t r1, const float* const* xs,
                 std::uint32_t n_x, float* out, std::vector<float>& tile) {
  const std::uint32_t cols = m.cols;
  if (cols % 16 != 0) {
    // dot's scalar tail (which the compiler may vectorise in part): row by row through dot.
    tile.resize(cols);
    for (std::uint32_t r = r0; r < r1; ++r) {
      m.row(r, tile.data());
      for (std::uint32_t e = 0; e < n_x; ++e)
        out[std::size_t(r - r0) * n_x + e] = dot(tile.data(), xs[e], cols);
    }
    return;
  }
#if defined(__AVX512F__)
  if (fused_fits(m, n_x)) {
    switch (n_x) {
      case 1: return fused_dots<1>(m, r0, r1, xs, out);
      case 2: return fused_dots<2>(m, r0, r1, xs, out);
      case 3: return fused_dots<3>(m, r0, r1, xs, out);
      case 4: return fused_dots<4>(m, r0, r1, xs, out);
      case 5: return fused_dots<5>(m, r0, r1, xs, out);
      case 6: return fused_dots<6>(m, r0, r1, xs, out);
      case 7: return fused_dots<7>(m, r0, r1, xs, out);
      default: return fused_dots<8>(m, r0, r1, xs, out);
    }
  }
#endif
  tile.resize(std::size_t(kBlockRows) * cols);
  for (std::uint32_t r = r0; r < r1; r += kBlockRows) {
    const std::uint32_t n = std::min(kBlockRows, r1 - r);
    for (std::uint32_t q = 0; q < n; ++q)
      dequant_row(m, r + q, tile.data() + std::size_t(q) * cols);
    float* o = out + std::size_t(r - r0) * n_x;
    switch (n) {
      case 1: block_dots<1>(tile.data(), xs, n_x, cols, o); break;
      case 2: block_dots<2>(tile.data(), xs, n_x, cols, o); break;
      case 3: block_dots<3>(tile.data(), xs, n_x, cols, o); break;
      default: block_dots<4>(tile.data(), xs, n_x, cols, o); break;
    }
  }
}

void route(const DeviceBuffers& b, std::uint32_t layer, std::uint32_t rows, std::int32_t* ids,
           float* weights, const ParallelFor& pf, const MoceParams& moce) {
  const PackLayout& L = *b.layout;
  const std::uint32_t E = L.n_experts, H = L.hidden, k = L.top_k;
  const float* router = b.routers + std::size_t(layer) * E * H;
  const bool adjust = moce.mode != MoceMode::Off && weights;
  if (adjust)  // one snapshot for the whole chunk: every token sees the same residency
    for (std::uint32_t e = 0; e < E; ++e)
      b.route_resident[e] = smap_load(b.smap, layer * E + e) != kAbsent;
  parallel_for(pf, rows, std::uint64_t(rows) * E * H, [&](std::uint32_t t0, std::uint32_t t1) {
    std::vector<std::uint32_t> order(E);
    std::vector<float> prob(adjust ? E : 0);
    std::vector<std::uint32_t> selected(adjust ? k : 0), scratch(adjust ? 2 * E : 0);
    auto by_logit = [&](const float* logit) {
      return [logit](std::uint32_t a, std::uint32_t c) {
        return logit[a] > logit[c] || (logit[a] == logit[c] && a < c);
      };
    };
    for (std::uint32_t t = t0; t < t1; ++t) {
      float* logit = b.logits + std::size_t(t) * E;
      const float* x = b.x + std::size_t(t) * H;
      for (std::uint32_t e = 0; e < E; ++e) logit[e] = dot(router + std::size_t(e) * H, x, H);
      // Top-k by logit (softmax is monotonic); ties go to the lower expert index.
      for (std::uint32_t e = 0; e < E; ++e) order[e] = e;
      float top;  // the largest logit: the softmax shift
      if (adjust) {
        // moce needs the whole ranking and the true probabilities (softmax over every expert,
        // whatever the routing rule: it is what the router says about each expert).
        std::sort(order.begin(), order.end(), by_logit(logit));
        top = logit[order[0]];
        float total = 0;
        for (std::uint32_t e = 0; e < E; ++e) total += std::exp(logit[e] - top);
        for (std::uint32_t e = 0; e < E; ++e) prob[e] = std::exp(logit[e] - top) / total;
        MoceDelta d = moce_select(moce, order.data(), prob.data(), b.route_resident, E, k,
                                  selected.data(), scratch.data());
        std::copy(selected.begin(), selected.end(), order.begin());
        b.moce_moved[t] = d.moved;
        b.moce_changed[t] = d.changed;
      } else {
        std::partial_sort(order.begin(), order.begin() + k, order.end(), by_logit(logit));
        top = logit[order[0]];
      }
      for (std::uint32_t j = 0; j < k; ++j) ids[std::size_t(t) * k + j] = std::int32_t(order[j]);
      if (!weights) continue;
      // Mixture weights: the model's own rule applied to the selected experts' true logits. The
      // moce scale factor only steers the choice; it is not evidence about the token, so it does
      // not enter the weights. A token whose selection moce left alone therefore gets bitwise
      // the weights of exact routing, and the block is exactly the model evaluated with that
      // selection (tests/test_moce.py checks both).
      float* w = weights + std::size_t(t) * k;
      if (L.routing == Routing::SoftmaxTopk) {
        // Softmax over every expert, then the chosen probabilities (renormalised if asked).
        float total = 0;
        for (std::uint32_t e = 0; e < E; ++e) total += std::exp(logit[e] - top);
        float chosen = 0;
        for (std::uint32_t j = 0; j < k; ++j) {
          w[j] = std::exp(logit[order[j]] - top) / total;
          chosen += w[j];
        }
        if (L.norm_topk_prob)
          for (std::uint32_t j = 0; j < k; ++j) w[j] /= chosen;
      } else {
        // Mixtral: softmax over the k chosen logits only, shifted by the largest of them (the
        // selection is in true-rank order; without moce it is the largest logit, `top`).
        const float top_chosen = logit[order[0]];
        float total = 0;
        for (std::uint32_t j = 0; j < k; ++j) total += std::exp(logit[order[j]] - top_chosen);
        for (std::uint32_t j = 0; j < k; ++j) w[j] = std::exp(logit[order[j]] - top_chosen) / total;
      }
    }
  });
}

void plan(const DeviceBuffers& b, std::uint32_t layer, std::uint32_t rows) {
  const std::uint32_t E = b.layout->n_experts, k = b.layout->top_k;
  for (std::uint32_t i = 0; i < rows * k; ++i)
    b.plan[i] = smap_load(b.smap, layer * E + std::uint32_t(b.ids[i]));
}

bool gate_up(const DeviceBuffers& b, std::uint32_t layer, std::uint32_t rows, Pass pass,
             const ParallelFor& pf, Rounding rounding) {
  std::vector<Group> groups;
  if (!resolve_pass(b, layer, rows, pass, &groups)) return false;
  run_groups(b, layer, groups, Stage::GateUp, pf, rounding);
  return true;
}

bool down(const DeviceBuffers& b, std::uint32_t layer, std::uint32_t rows, Pass pass,
          const ParallelFor& pf, Rounding rounding) {
  std::vector<Group> groups;
  if (!resolve_pass(b, layer, rows, pass, &groups)) return false;
  run_groups(b, layer, groups, Stage::Down, pf, rounding);
  return true;
}

bool moe_mm(const DeviceBuffers& b, std::uint32_t layer, std::uint32_t rows, const ParallelFor& pf,
            Rounding rounding) {
  const std::uint32_t E = b.layout->n_experts;
  const std::uint32_t n_wave = *b.wave_n;
  std::vector<char> in_wave(E, 0);
  for (std::uint32_t w = 0; w < n_wave; ++w) in_wave[std::uint32_t(b.wave[w])] = 1;
  auto groups = group_entries(b, rows, [&](std::uint32_t, std::uint32_t e) { return in_wave[e]; });
  for (Group& g : groups) {
    g.slot = smap_load(b.smap, layer * E + g.expert);
    if (g.slot == kAbsent || g.slot >= b.n_slots) return false;
  }
  run_groups(b, layer, groups, Stage::Both, pf, rounding);
  return true;
}

void combine(const DeviceBuffers& b, std::uint32_t rows, const ParallelFor& pf) {
  const std::uint32_t H = b.layout->hidden, k = b.layout->top_k;
  parallel_for(pf, rows, std::uint64_t(rows) * k * H, [&](std::uint32_t t0, std::uint32_t t1) {
    for (std::uint32_t t = t0; t < t1; ++t) {
      float* o = b.out + std::size_t(t) * H;
      const float* y0 = b.y + std::size_t(t) * k * H;
      std::copy(y0, y0 + H, o);
      for (std::uint32_t j = 1; j < k; ++j) {
        const float* yj = y0 + std::size_t(j) * H;
        for (std::uint32_t c = 0; c < H; ++c) o[c] += yj[c];
      }
    }
  });
}

}  // namespace strata::cpu
