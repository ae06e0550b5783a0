// What one pinned host-to-device copy costs the copy engine, by size and by how many streams
// the copies are spread over: the figure behind the CUDA mirror's copy chunks (docs/cuda.md,
// "Copy chunks"). For each size: one copy alone (issue, then wait for its event: what a lone
// miss pays), then 512 MiB as back-to-back copies of that size over 1, 2, 4, 8 and 16 streams
// (the engine's throughput and the time each copy holds it), and the same bytes moved by a kernel
// reading the pinned memory through its device mapping instead of by the copy engine.
//   nvcc -O2 -std=c++17 -arch=sm_90 -o copy_engine benchmarks/native/cuda_copy_engine.cu
//   copy_engine            (prints a markdown table; medians)
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

void ck(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  std::fprintf(stderr, "cuda_copy_engine: %s: %s\n", what, cudaGetErrorString(e));
  std::exit(1);
}

double us_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

__global__ void mapped_copy(const uint4* __restrict__ src, uint4* __restrict__ dst,
                            std::size_t n16) {
  const std::size_t stride = std::size_t(gridDim.x) * blockDim.x;
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n16; i += stride)
    dst[i] = src[i];
}

}  // namespace

int main() {
  constexpr std::size_t kTotal = std::size_t(512) << 20;
  constexpr int kStreams[] = {1, 2, 4, 8, 16};
  // 64 KiB, a balanced q4 part (176 KiB), the part cap (256 KiB), 512 KiB, 1 MiB (the default
  // chunk), a q4 Qwen3-30B-A3B record (2.53 MiB).
  constexpr std::size_t kSizes[] = {65536, 180224, 262144, 524288, 1048576, 2654208};
  unsigned char *host = nullptr, *dev = nullptr, *mapped = nullptr;
  ck(cudaHostAlloc(&host, kTotal, cudaHostAllocMapped), "cudaHostAlloc");
  std::memset(host, 1, kTotal);
  ck(cudaHostGetDevicePointer(reinterpret_cast<void**>(&mapped), host, 0), "device pointer");
  ck(cudaMalloc(&dev, kTotal), "cudaMalloc");
  std::vector<cudaStream_t> streams(16);
  for (auto& s : streams) ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  cudaEvent_t done;
  ck(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreate");

  std::printf("| bytes a copy | one copy alone, us | back to back, us a copy (GB/s): 1 stream "
              "| 2 | 4 | 8 | 16 | a kernel reading the mapping alone, us |\n");
  std::printf("|---|---|---|---|---|---|---|---|\n");
  for (const std::size_t size : kSizes) {
    std::vector<double> alone, kernel;
    for (int i = 0; i < 31; ++i) {
      const auto t0 = Clock::now();
      ck(cudaMemcpyAsync(dev, host + (i % 8) * size, size, cudaMemcpyHostToDevice, streams[0]),
         "cudaMemcpyAsync");
      ck(cudaEventRecord(done, streams[0]), "cudaEventRecord");
      ck(cudaEventSynchronize(done), "cudaEventSynchronize");
      alone.push_back(us_since(t0));
      const auto t1 = Clock::now();
      mapped_copy<<<132, 256, 0, streams[0]>>>(
          reinterpret_cast<const uint4*>(mapped + (i % 8) * size), reinterpret_cast<uint4*>(dev),
          size / 16);
      ck(cudaEventRecord(done, streams[0]), "cudaEventRecord");
      ck(cudaEventSynchronize(done), "cudaEventSynchronize (kernel)");
      kernel.push_back(us_since(t1));
    }
    std::printf("| %zu | %.1f", size, median(alone));
    for (const int n_streams : kStreams) {
      const std::size_t n = kTotal / size;
      ck(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
      const auto t0 = Clock::now();
      for (std::size_t i = 0; i < n; ++i)
        ck(cudaMemcpyAsync(dev + i * size, host + i * size, size, cudaMemcpyHostToDevice,
                           streams[i % std::size_t(n_streams)]),
           "cudaMemcpyAsync");
      ck(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
      const double us = us_since(t0);
      std::printf(" | %.1f (%.1f)", us / double(n), double(n * size) / us / 1e3);
    }
    std::printf(" | %.1f |\n", median(kernel));
  }
  for (auto& s : streams) cudaStreamDestroy(s);
  cudaEventDestroy(done);
  cudaFree(dev);
  cudaFreeHost(host);
  return 0;
}
