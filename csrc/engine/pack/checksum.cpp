#include "pack/checksum.h"

#include <array>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#include <nmmintrin.h>
#define STRATA_CRC32C_X86 1
#elif defined(__aarch64__) && defined(__ARM_FEATURE_CRC32)
#include <arm_acle.h>
#define STRATA_CRC32C_ARM 1
#endif

namespace strata {
namespace {

constexpr std::uint32_t kPoly = 0x82F63B78u;  // Castagnoli, bit-reflected

// The CRC engine works on the raw register (the complement of the public value), the form the
// hardware instructions take and return.
struct Tables {
  // Slicing by 8: bytes[k][b] advances the register over byte b followed by k zero bytes.
  std::array<std::array<std::uint32_t, 256>, 8> bytes{};
  // Register after appending kLong (kShort) zero bytes, as a GF(2)-linear map split by byte of
  // the register: the combine step of the three-way interleaved hardware loop.
  std::array<std::array<std::uint32_t, 256>, 4> shift_long{}, shift_short{};

  Tables() {
    for (std::uint32_t b = 0; b < 256; ++b) {
      std::uint32_t r = b;
      for (int i = 0; i < 8; ++i) r = (r >> 1) ^ (kPoly & (0u - (r & 1u)));
      bytes[0][b] = r;
    }
    for (int k = 1; k < 8; ++k)
      for (std::uint32_t b = 0; b < 256; ++b) {
        std::uint32_t prev = bytes[k - 1][b];
        bytes[k][b] = (prev >> 8) ^ bytes[0][prev & 0xFF];
      }
  }
  void build_shift(std::array<std::array<std::uint32_t, 256>, 4>& out, std::size_t zeros) const {
    std::uint32_t column[32];
    for (int bit = 0; bit < 32; ++bit) {
      std::uint32_t r = 1u << bit;
      for (std::size_t i = 0; i < zeros; ++i) r = (r >> 8) ^ bytes[0][r & 0xFF];
      column[bit] = r;
    }
    for (int k = 0; k < 4; ++k)
      for (std::uint32_t b = 0; b < 256; ++b) {
        std::uint32_t v = 0;
        for (int j = 0; j < 8; ++j)
          if (b & (1u << j)) v ^= column[8 * k + j];
        out[std::size_t(k)][b] = v;
      }
  }
};

// Block sizes of the interleaved loop: three independent streams hide the CRC instruction's
// three-cycle latency; the long blocks amortise the combine, the short ones serve the tail.
constexpr std::size_t kLong = 8192;
constexpr std::size_t kShort = 256;

const Tables& tables() {
  static const Tables t = [] {
    Tables x;
    x.build_shift(x.shift_long, kLong);
    x.build_shift(x.shift_short, kShort);
    return x;
  }();
  return t;
}

inline std::uint32_t shift(const std::array<std::array<std::uint32_t, 256>, 4>& z,
                           std::uint32_t r) {
  return z[0][r & 0xFF] ^ z[1][(r >> 8) & 0xFF] ^ z[2][(r >> 16) & 0xFF] ^ z[3][r >> 24];
}

inline std::uint64_t load64(const unsigned char* p) {
  std::uint64_t v;
  std::memcpy(&v, p, 8);  // little-endian targets only (as the pack format)
  return v;
}

std::uint32_t table_update(std::uint32_t r, const unsigned char* p, std::size_t n) {
  const Tables& t = tables();
  while (n >= 8) {
    std::uint64_t w = load64(p) ^ r;
    r = t.bytes[7][w & 0xFF] ^ t.bytes[6][(w >> 8) & 0xFF] ^ t.bytes[5][(w >> 16) & 0xFF] ^
        t.bytes[4][(w >> 24) & 0xFF] ^ t.bytes[3][(w >> 32) & 0xFF] ^
        t.bytes[2][(w >> 40) & 0xFF] ^ t.bytes[1][(w >> 48) & 0xFF] ^ t.bytes[0][w >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) r = (r >> 8) ^ t.bytes[0][(r ^ *p++) & 0xFF];
  return r;
}

// The hardware loop, written once for both instruction sets: STEP8(r, u64) and STEP1(r, u8)
// are the CRC instructions. A macro rather than a template: x86 needs the whole loop inside one
// function compiled for SSE4.2 so the intrinsics inline.
#define STRATA_CRC32C_HW_BODY(STEP8, STEP1)                                               \
  const Tables& t = tables();                                                             \
  while (n > 0 && (reinterpret_cast<std::uintptr_t>(p) & 7) != 0) {                       \
    r = STEP1(r, *p++);                                                                   \
    --n;                                                                                  \
  }                                                                                       \
  for (std::size_t block : {kLong, kShort}) {                                             \
    const auto& z = block == kLong ? t.shift_long : t.shift_short;                        \
    while (n >= 3 * block) {                                                              \
      std::uint64_t r0 = r, r1 = 0, r2 = 0;                                               \
      for (const unsigned char* end = p + block; p < end; p += 8) {                       \
        r0 = STEP8(r0, load64(p));                                                        \
        r1 = STEP8(r1, load64(p + block));                                                \
        r2 = STEP8(r2, load64(p + 2 * block));                                            \
      }                                                                                   \
      r = shift(z, std::uint32_t(r0)) ^ std::uint32_t(r1);                                \
      r = shift(z, r) ^ std::uint32_t(r2);                                                \
      p += 2 * block;                                                                     \
      n -= 3 * block;                                                                     \
    }                                                                                     \
  }                                                                                       \
  for (; n >= 8; n -= 8, p += 8) r = std::uint32_t(STEP8(r, load64(p)));                  \
  while (n--) r = STEP1(r, *p++);                                                         \
  return r;

#if defined(STRATA_CRC32C_X86)
__attribute__((target("sse4.2"))) std::uint32_t hw_update(std::uint32_t r, const unsigned char* p,
                                                          std::size_t n) {
#define STRATA_X86_STEP8(c, v) _mm_crc32_u64((c), (v))
#define STRATA_X86_STEP1(c, b) _mm_crc32_u8((c), (b))
  STRATA_CRC32C_HW_BODY(STRATA_X86_STEP8, STRATA_X86_STEP1)
#undef STRATA_X86_STEP8
#undef STRATA_X86_STEP1
}
bool detect_hw() { return __builtin_cpu_supports("sse4.2"); }
constexpr const char* kHwName = "sse4.2";

// Folding with carry-less multiplication (AVX-512 VPCLMULQDQ), for long buffers: the `crc32`
// instruction retires 8 bytes a cycle at best (three interleaved streams), while four 512-bit
// accumulators folded by VPCLMULQDQ take 256 bytes in eight multiplications, so a record part's
// check costs a fraction of its read (benchmarks/io_path.py measures the CRC's share of the IO
// threads' time). The CRC is a remainder modulo the
// polynomial P, and for a 16-byte block A followed by d bytes,
//   A * x^(8d) = L * x^(8d + 64) + H * x^(8d)  (mod P)
// where L is A's first 8 bytes (in the reflected bit order the higher-degree half) and H its
// last 8; each product of a 64-bit half and a 32-bit constant fits 128 bits, so the block is
// replaced by the two products XORed into the block d bytes later, and the message's CRC does
// not change. What is left at the end, one 16-byte block and a tail, the `crc32` instruction
// finishes from a zero register (the initial register is XORed into the first 4 bytes, as that
// instruction does with its own).
constexpr std::size_t kFoldMin = 1024;  // below this the setup outweighs the gain

// x^n modulo P in the table's bit order (bit 31 is x^0): n multiplications by x.
std::uint32_t x_pow_mod(std::size_t n) {
  std::uint32_t r = 1u << 31;
  while (n--) r = (r & 1u) ? (r >> 1) ^ kPoly : r >> 1;
  return r;
}

// The two multipliers that fold a 16-byte block forward by d bytes: x^(8d + 64) for its first
// half and x^(8d) for its second, each times x^-1 (a carry-less product of two bit-reflected
// operands comes out one bit position up, a factor x), bit-reflected into the high half of a
// 64-bit word (coefficient of x^e at bit 63 - e).
struct FoldKey {
  std::uint64_t first, last;
};
FoldKey fold_key(std::size_t d) {
  return {std::uint64_t(x_pow_mod(8 * d + 63)) << 32, std::uint64_t(x_pow_mod(8 * d - 1)) << 32};
}
struct FoldKeys {
  FoldKey by256, by64, by48, by32, by16;
};
const FoldKeys& fold_keys() {
  static const FoldKeys k{fold_key(256), fold_key(64), fold_key(48), fold_key(32), fold_key(16)};
  return k;
}

#define STRATA_FOLD_TARGET __attribute__((target("avx512f,vpclmulqdq,pclmul,sse4.2")))

STRATA_FOLD_TARGET inline __m512i fold512(__m512i x, __m512i k, __m512i next) {
  return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x00),
                                   _mm512_clmulepi64_epi128(x, k, 0x11), next, 0x96);
}
STRATA_FOLD_TARGET inline __m512i key512(const FoldKey& k) {
  const auto a = static_cast<long long>(k.first), b = static_cast<long long>(k.last);
  return _mm512_set_epi64(b, a, b, a, b, a, b, a);
}
STRATA_FOLD_TARGET inline __m128i fold128(__m128i x, const FoldKey& k) {
  const __m128i key =
      _mm_set_epi64x(static_cast<long long>(k.last), static_cast<long long>(k.first));
  return _mm_xor_si128(_mm_clmulepi64_si128(x, key, 0x00), _mm_clmulepi64_si128(x, key, 0x11));
}

// The raw register after n >= kFoldMin bytes.
STRATA_FOLD_TARGET std::uint32_t fold_update(std::uint32_t r, const unsigned char* p,
                                             std::size_t n) {
  const FoldKeys& K = fold_keys();
  __m512i x0 = _mm512_loadu_si512(p), x1 = _mm512_loadu_si512(p + 64);
  __m512i x2 = _mm512_loadu_si512(p + 128), x3 = _mm512_loadu_si512(p + 192);
  x0 = _mm512_xor_si512(x0, _mm512_zextsi128_si512(_mm_cvtsi32_si128(static_cast<int>(r))));
  p += 256;
  n -= 256;
  const __m512i by256 = key512(K.by256);
  for (; n >= 256; p += 256, n -= 256) {
    x0 = fold512(x0, by256, _mm512_loadu_si512(p));
    x1 = fold512(x1, by256, _mm512_loadu_si512(p + 64));
    x2 = fold512(x2, by256, _mm512_loadu_si512(p + 128));
    x3 = fold512(x3, by256, _mm512_loadu_si512(p + 192));
  }
  const __m512i by64 = key512(K.by64);
  x1 = fold512(x0, by64, x1);
  x2 = fold512(x1, by64, x2);
  x3 = fold512(x2, by64, x3);
  // x3's four lanes are the 64 bytes before p: fold the first three onto the last.
  __m128i acc = _mm512_extracti32x4_epi32(x3, 3);
  acc = _mm_xor_si128(acc, fold128(_mm512_extracti32x4_epi32(x3, 0), K.by48));
  acc = _mm_xor_si128(acc, fold128(_mm512_extracti32x4_epi32(x3, 1), K.by32));
  acc = _mm_xor_si128(acc, fold128(_mm512_extracti32x4_epi32(x3, 2), K.by16));
  std::uint64_t c = _mm_crc32_u64(0, static_cast<std::uint64_t>(_mm_cvtsi128_si64(acc)));
  c = _mm_crc32_u64(c, static_cast<std::uint64_t>(_mm_extract_epi64(acc, 1)));
  return hw_update(std::uint32_t(c), p, n);
}
#undef STRATA_FOLD_TARGET

bool detect_fold() {
  return __builtin_cpu_supports("sse4.2") && __builtin_cpu_supports("pclmul") &&
         __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("vpclmulqdq");
}
constexpr const char* kFoldName = "avx512-vpclmulqdq";
#elif defined(STRATA_CRC32C_ARM)
std::uint32_t hw_update(std::uint32_t r, const unsigned char* p, std::size_t n) {
#define STRATA_ARM_STEP8(c, v) __crc32cd(std::uint32_t(c), (v))
#define STRATA_ARM_STEP1(c, b) __crc32cb((c), (b))
  STRATA_CRC32C_HW_BODY(STRATA_ARM_STEP8, STRATA_ARM_STEP1)
#undef STRATA_ARM_STEP8
#undef STRATA_ARM_STEP1
}
bool detect_hw() { return true; }  // the compiler was told the target has the CRC extension
constexpr const char* kHwName = "armv8-crc";
#else
std::uint32_t hw_update(std::uint32_t r, const unsigned char* p, std::size_t n) {
  return table_update(r, p, n);
}
bool detect_hw() { return false; }
constexpr const char* kHwName = "table";
#endif

#undef STRATA_CRC32C_HW_BODY

bool have_hw() {
  static const bool hw = detect_hw();
  return hw;
}

#if defined(STRATA_CRC32C_X86)
bool have_fold() {
  static const bool fold = detect_fold();
  return fold;
}
#endif

// The raw register after n bytes, on the fastest implementation this machine has.
std::uint32_t update(std::uint32_t r, const unsigned char* p, std::size_t n) {
#if defined(STRATA_CRC32C_X86)
  if (n >= kFoldMin && have_fold()) return fold_update(r, p, n);
#endif
  return have_hw() ? hw_update(r, p, n) : table_update(r, p, n);
}

}  // namespace

std::uint32_t crc32c(const void* data, std::size_t n, std::uint32_t seed) {
  const auto* p = static_cast<const unsigned char*>(data);
  return ~update(~seed, p, n);
}

std::uint32_t crc32c_portable(const void* data, std::size_t n, std::uint32_t seed) {
  return ~table_update(~seed, static_cast<const unsigned char*>(data), n);
}

namespace {

// a * b modulo the (reflected) polynomial: bit 31 is x^0.
std::uint32_t mul_mod_poly(std::uint32_t a, std::uint32_t b) {
  std::uint32_t m = 1u << 31, p = 0;
  for (;;) {
    if (a & m) {
      p ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;
  }
  return p;
}

// x^(2^k) modulo the polynomial, k = 0..31 (the powers repeat with a period dividing 2^32 - 1).
const std::array<std::uint32_t, 32>& x_pow2k() {
  static const std::array<std::uint32_t, 32> t = [] {
    std::array<std::uint32_t, 32> v{};
    std::uint32_t p = 1u << 30;  // x^1
    v[0] = p;
    for (std::size_t k = 1; k < 32; ++k) v[k] = p = mul_mod_poly(p, p);
    return v;
  }();
  return t;
}

}  // namespace

std::uint32_t crc32c_combine(std::uint32_t crc_a, std::uint32_t crc_b, std::uint64_t len_b) {
  // crc(a + b) = crc(a) * x^(8 len_b) + crc(b), modulo the polynomial; the pre- and
  // post-conditioning of the public CRC cancel out of this form.
  std::uint32_t xp = 1u << 31;  // x^0
  for (std::size_t k = 3; len_b != 0; len_b >>= 1, ++k)
    if (len_b & 1) xp = mul_mod_poly(x_pow2k()[k & 31], xp);
  return mul_mod_poly(xp, crc_a) ^ crc_b;
}

bool crc32c_hardware() { return have_hw(); }

const char* crc32c_impl() {
#if defined(STRATA_CRC32C_X86)
  if (have_fold()) return kFoldName;
#endif
  return have_hw() ? kHwName : "table";
}

}  // namespace strata
