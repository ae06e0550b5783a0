// Programmatic dependent launch (Hopper and later): a kernel launched with it may start while
// the kernel before it on the stream is still running, so its prologue (loads of data no earlier
// kernel writes: expert weights, routers) overlaps that kernel's tail and its launch latency is
// hidden. Such a kernel must call pdl_wait() before it touches anything an earlier kernel wrote
// (griddepcontrol.wait returns once every earlier grid has completed and its writes are
// visible; in a kernel launched without the attribute it returns at once). pdl_trigger() lets the
// next kernel's blocks be scheduled before this one's blocks have all finished.
#pragma once

#include <cuda_runtime.h>

#include <utility>

namespace strata::cuda {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Whether `kernel` may be launched early: the device is Hopper or later and the kernel's code
// was built for it (a binary built for an older architecture has no griddepcontrol.wait, and
// launching it early would race). Asked once per kernel by the caller.
template <class Kernel>
bool pdl_capable(Kernel kernel) {
  int dev = 0, major = 0;
  cudaFuncAttributes a{};
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaFuncGetAttributes(&a, kernel) != cudaSuccess) {
    cudaGetLastError();  // a failed query is not the launch's error
    return false;
  }
  return major >= 9 && a.binaryVersion >= 90 && a.ptxVersion >= 90;
}

// kernel<<<grid, block, smem, s>>>(args...), early (programmatic stream serialization) when
// `early` is set.
template <class... Params, class... Args>
cudaError_t launch(void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t smem,
                   cudaStream_t s, bool early, Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = early ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

}  // namespace strata::cuda
