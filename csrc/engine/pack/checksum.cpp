#include "pack/checksum.h"

#include <array>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
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

}  // namespace

std::uint32_t crc32c(const void* data, std::size_t n, std::uint32_t seed) {
  const auto* p = static_cast<const unsigned char*>(data);
  std::uint32_t r = ~seed;
  r = have_hw() ? hw_update(r, p, n) : table_update(r, p, n);
  return ~r;
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

const char* crc32c_impl() { return have_hw() ? kHwName : "table"; }

}  // namespace strata
