// Probes the GPU -> host -> GPU crossing a per-layer handshake needs, one mechanism at a time,
// and prints microseconds per crossing (median of N). Every wait is bounded: a mechanism that
// never completes is reported as such, not waited on forever (issue 17 saw cuStreamWaitValue32
// on mapped memory never complete on this machine).
//   nvcc -O2 -arch=sm_90 -o probe cuda_handshake_probe.cu -lcuda && ./probe
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

using Clock = std::chrono::steady_clock;

#define CK(x)                                                                        \
  do {                                                                               \
    cudaError_t e_ = (x);                                                            \
    if (e_ != cudaSuccess) {                                                         \
      std::printf("  %s failed: %s\n", #x, cudaGetErrorString(e_));                  \
      return -1;                                                                     \
    }                                                                                \
  } while (0)

__global__ void tiny(int* p) {
  if (threadIdx.x == 0) p[0] += 1;
}

// Spins until the host's value reaches `want`, then answers with `want` (mapped memory both ways).
__global__ void spin_answer(volatile unsigned* from_host, volatile unsigned* to_host, unsigned n,
                            unsigned long long timeout_cycles) {
  for (unsigned i = 1; i <= n; ++i) {
    const long long t0 = clock64();
    while (from_host[0] < i)
      if (clock64() - t0 > (long long)timeout_cycles) return;
    __threadfence_system();
    to_host[0] = i;
  }
}

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// (a) host-paced: launch a kernel, synchronize the stream (what the backend's Signal does).
static int host_paced(cudaStream_t s, int* d, int n) {
  std::vector<double> us;
  for (int i = 0; i < n; ++i) {
    auto t0 = Clock::now();
    tiny<<<1, 32, 0, s>>>(d);
    CK(cudaStreamSynchronize(s));
    us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  std::printf("launch+cudaStreamSynchronize: %.1f us per crossing\n", median(us));
  return 0;
}

// (b) an event recorded after the kernel, host spins on cudaEventQuery.
static int event_spin(cudaStream_t s, int* d, int n) {
  cudaEvent_t ev;
  CK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  std::vector<double> us;
  for (int i = 0; i < n; ++i) {
    auto t0 = Clock::now();
    tiny<<<1, 32, 0, s>>>(d);
    CK(cudaEventRecord(ev, s));
    while (cudaEventQuery(ev) == cudaErrorNotReady) {
    }
    us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  std::printf("launch+event record+query spin: %.1f us per crossing\n", median(us));
  cudaEventDestroy(ev);
  return 0;
}

struct HostFlag {
  std::atomic<unsigned> v{0};
};
static void CUDART_CB bump(void* p) { static_cast<HostFlag*>(p)->v.fetch_add(1); }

// (c) cudaLaunchHostFunc after the kernel: the host sees the callback.
static int host_func(cudaStream_t s, int* d, int n) {
  HostFlag f;
  std::vector<double> us;
  for (int i = 0; i < n; ++i) {
    const unsigned want = f.v.load() + 1;
    auto t0 = Clock::now();
    tiny<<<1, 32, 0, s>>>(d);
    CK(cudaLaunchHostFunc(s, bump, &f));
    while (f.v.load() < want) {
    }
    us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  CK(cudaStreamSynchronize(s));
  std::printf("launch+cudaLaunchHostFunc: %.1f us per crossing\n", median(us));
  return 0;
}

// (d) a resident kernel and mapped flags both ways: the floor (it holds one SM while it spins).
static int mapped_spin(cudaStream_t s, int n) {
  unsigned *h = nullptr, *d = nullptr;
  CK(cudaHostAlloc(&h, 2 * sizeof(unsigned), cudaHostAllocMapped));
  h[0] = h[1] = 0;
  CK(cudaHostGetDevicePointer(&d, h, 0));
  volatile unsigned* hv = h;
  spin_answer<<<1, 1, 0, s>>>(d, d + 1, n, 4000000000ull);
  CK(cudaGetLastError());
  std::vector<double> us;
  for (int i = 1; i <= n; ++i) {
    auto t0 = Clock::now();
    std::atomic_thread_fence(std::memory_order_seq_cst);
    hv[0] = unsigned(i);
    auto deadline = t0 + std::chrono::seconds(2);
    while (hv[1] < unsigned(i))
      if (Clock::now() > deadline) {
        std::printf("mapped flag spin: no answer within 2 s at crossing %d\n", i);
        cudaStreamSynchronize(s);
        cudaFreeHost(h);
        return 0;
      }
    us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  CK(cudaStreamSynchronize(s));
  std::printf("resident kernel, mapped flags both ways: %.1f us per crossing\n", median(us));
  cudaFreeHost(h);
  return 0;
}

// (e) cuStreamWaitValue32 on mapped host memory, released by a host store.
static int wait_value(cudaStream_t s, int* d, int n) {
  unsigned* h = nullptr;
  CK(cudaHostAlloc(&h, 64, cudaHostAllocMapped));
  h[0] = 0;
  CUdeviceptr dp = 0;
  CK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dp), h, 0));
  int supported = 0;
  CUdevice dev;
  cuDeviceGet(&dev, 0);
  cuDeviceGetAttribute(&supported, CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR, dev);
  std::printf("cuStreamWaitValue32: NOR attribute %d\n", supported);
  volatile unsigned* hv = h;
  std::vector<double> us;
  for (int i = 1; i <= n; ++i) {
    CUresult r = cuStreamWaitValue32(reinterpret_cast<CUstream>(s), dp, cuuint32_t(i),
                                     CU_STREAM_WAIT_VALUE_GEQ);
    if (r != CUDA_SUCCESS) {
      const char* m = nullptr;
      cuGetErrorString(r, &m);
      std::printf("cuStreamWaitValue32 refused: %s\n", m ? m : "?");
      return 0;
    }
    tiny<<<1, 32, 0, s>>>(d);
    auto t0 = Clock::now();
    hv[0] = unsigned(i);
    auto deadline = t0 + std::chrono::seconds(2);
    while (cudaStreamQuery(s) == cudaErrorNotReady)
      if (Clock::now() > deadline) {
        std::printf("cuStreamWaitValue32 on mapped memory: not released within 2 s (crossing %d);"
                    " abandoning it\n", i);
        return 1;  // the stream stays stuck: the caller exits
      }
    us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  std::printf("cuStreamWaitValue32 (mapped) + kernel: %.1f us per crossing\n", median(us));
  return 0;
}

int main() {
  cudaDeviceProp p;
  CK(cudaGetDeviceProperties(&p, 0));
  std::printf("device: %s, %d SMs\n", p.name, p.multiProcessorCount);
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  int* d = nullptr;
  CK(cudaMalloc(&d, 4));
  for (int i = 0; i < 50; ++i) tiny<<<1, 32, 0, s>>>(d);  // warm up
  CK(cudaStreamSynchronize(s));
  const int n = 2000;
  host_paced(s, d, n);
  event_spin(s, d, n);
  host_func(s, d, n);
  mapped_spin(s, n);
  if (wait_value(s, d, 200) != 0) std::_Exit(0);
  return 0;
}
