// The tensor-core primitives of the bf16 expert kernels (mma_experts.cu), as inline PTX (sm_80
// and later; no cuda_bf16.h, whose CCCL dependency PyPI's nvcc wheel lacks): the exact split of a
// float into three bf16 pieces, cp.async staging, ldmatrix and the m16n8k16 bf16 MMA with float32
// accumulation.
#pragma once

#include <cstdint>

namespace strata::cuda {

__device__ __forceinline__ std::uint16_t bf16_rn(float x) {
  std::uint16_t h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
  return h;
}
__device__ __forceinline__ float bf16_float(std::uint16_t b) {
  return __uint_as_float(std::uint32_t(b) << 16);
}

// x = hi + mid + lo exactly, each a bf16 (for every normal x whose lo is no bf16 subnormal):
// hi = bf16(x) keeps x's top 8 significant bits, x - hi is exact in float32 and needs at most 16,
// mid = bf16(x - hi) keeps 8 of them, and what is left (x - hi - mid, exact again) fits in 8. So
// w * hi + w * mid + w * lo is w * x with every product exact in float32 (8 x 8 bits).
__device__ __forceinline__ void split3(float x, std::uint16_t& hi, std::uint16_t& mid,
                                       std::uint16_t& lo) {
  hi = bf16_rn(x);
  const float r1 = __fsub_rn(x, bf16_float(hi));
  mid = bf16_rn(r1);
  lo = bf16_rn(__fsub_rn(r1, bf16_float(mid)));
}

__device__ __forceinline__ std::uint32_t shared_addr(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, asynchronously; `full` false writes 16 zero bytes and reads nothing.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool full) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_addr(dst)),
               "l"(src), "r"(full ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int Pending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending) : "memory");
}

// Four 8x8 b16 matrices; lane l gives the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void ldmatrix_x4(std::uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_addr(p)));
}
// Two matrices (lanes 0-15 give the addresses; the others' are ignored but kept valid).
__device__ __forceinline__ void ldmatrix_x2(std::uint32_t (&r)[2], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(shared_addr(p)));
}

// d += a (16 x 16, row-major) * b (16 x 8, column-major): bf16 products, float32 sums. Element
// (m, n) depends only on row m of a, column n of b and d's (m, n): one hardware order.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const std::uint32_t (&a)[4],
                                         std::uint32_t b0, std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

}  // namespace strata::cuda
