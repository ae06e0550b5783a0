// The tensor-core primitives of the bf16 expert kernels (mma_experts.cu), as inline PTX (no
// cuda_bf16.h, whose CCCL dependency PyPI's nvcc wheel lacks): the exact split of a float into
// three bf16 pieces, cp.async staging, and Hopper's wgmma (sm_90a) descriptors, fences and waits;
// the instructions themselves are in wgmma_ops.cuh.
#pragma once

#include <cstdint>

#include "wgmma_ops.cuh"

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

// wgmma (sm_90a). A shared-memory matrix descriptor for a K-major tile of bf16 rows 128 bytes
// long (64 columns) in the 128-byte swizzle: 16-byte chunk c of row r stored at chunk c ^ (r % 8),
// the tile 1024-byte aligned, 8-row groups 1024 bytes apart (the stride byte offset); the leading
// byte offset is unused in this layout (1 by convention). A k-block of 16 columns further along
// the row starts 32 bytes further: the hardware applies the swizzle to the address it computes.
__device__ __forceinline__ std::uint64_t wgmma_desc(std::uint32_t smem_addr) {
  return (std::uint64_t(smem_addr & 0x3FFFF) >> 4) | (std::uint64_t(16 >> 4) << 16) |
         (std::uint64_t(1024 >> 4) << 32) | (std::uint64_t(1) << 62);
}
// Byte offset of column `col` (a multiple of 8) of row `r` in such a tile.
__device__ __forceinline__ std::uint32_t swizzled(std::uint32_t r, std::uint32_t col) {
  return r * 128 + (((col >> 3) ^ (r & 7)) << 4);
}
// Orders this thread's register accesses before the warpgroup's next wgmma (wgmma.fence).
__device__ __forceinline__ void wgmma_arrive() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Waits until at most `Pending` committed wgmma groups are in flight (their shared-memory reads
// and accumulator writes done for the others).
template <int Pending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(Pending) : "memory");
}
// Keeps the compiler from moving accesses of accumulators that a wgmma in flight owns.
template <int N>
__device__ __forceinline__ void wgmma_hold(float* d) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// Shared memory this thread wrote through the generic proxy (stores, cp.async), made visible to
// the async proxy that wgmma reads through; a barrier after it publishes it to the warpgroups.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

}  // namespace strata::cuda
