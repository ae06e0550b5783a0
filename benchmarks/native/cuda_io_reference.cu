// The fair raw IO reference for benchmarks/cuda.py --decode: the bytes a path from the page cache
// (or the SSD) to device memory moves per second with no engine in it, at the engine's shape:
// `threads` threads taking consecutive parts of `part` bytes from a shared counter (as
// ExpertStream's IO threads take a record's parts), each part pread into one of the thread's
// `depth` pinned buffers and then copied to its place in a device buffer with cudaMemcpyAsync on
// the thread's own stream. A buffer is reused only once its copy's event completed, so the next
// preads overlap the copies in flight (depth 1 would wait for each copy). Also the pinned
// host-to-device bandwidth alone (one large pinned buffer, one copy, median of 5).
// --arena: the engine's shape instead: each part pread into its own place in one pinned host
// buffer of BYTES (as the IO threads read into the registered arena) and copied from there, so
// no buffer is reused and the preads write a destination far larger than the caches.
//   nvcc -O2 -std=c++17 -o io_ref benchmarks/native/cuda_io_reference.cu
//   io_ref FILE OFFSET BYTES PART THREADS DEPTH [--direct] [--arena]
// prints one JSON object: {"bytes", "seconds", "gb_s", "pinned_h2d_gb_s", ..., "us_a_part"}, the
// last saying where a part's time went on its thread: waiting for its buffer's previous copy,
// the pread, queueing the copy.
#include <cuda_runtime.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "cuda_io_reference: %s\n", what.c_str());
  std::exit(1);
}

void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail(std::string(what) + ": " + cudaGetErrorString(e));
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double pinned_h2d(std::size_t bytes) {
  void *src = nullptr, *dst = nullptr;
  ck(cudaMallocHost(&src, bytes), "cudaMallocHost");
  ck(cudaMalloc(&dst, bytes), "cudaMalloc");
  std::memset(src, 1, bytes);
  cudaStream_t s;
  ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  std::vector<double> t;
  for (int i = 0; i < 6; ++i) {
    const auto t0 = Clock::now();
    ck(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s), "cudaMemcpyAsync");
    ck(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    if (i > 0) t.push_back(seconds_since(t0));
  }
  std::sort(t.begin(), t.end());
  cudaStreamDestroy(s);
  cudaFreeHost(src);
  cudaFree(dst);
  return double(bytes) / t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 7) fail("usage: io_ref FILE OFFSET BYTES PART THREADS DEPTH [--direct] [--arena]");
  const std::string path = argv[1];
  const std::uint64_t offset = std::strtoull(argv[2], nullptr, 10);
  const std::uint64_t bytes = std::strtoull(argv[3], nullptr, 10);
  const std::uint64_t part = std::strtoull(argv[4], nullptr, 10);
  const unsigned threads = unsigned(std::strtoul(argv[5], nullptr, 10));
  const unsigned depth = unsigned(std::strtoul(argv[6], nullptr, 10));
  bool direct = false, arena = false;
  for (int i = 7; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--direct") direct = true;
    else if (flag == "--arena") arena = true;
    else fail("unknown flag " + flag);
  }
  if (part == 0 || part % 4096 || threads == 0 || depth == 0 || bytes < part)
    fail("PART a positive multiple of 4096, THREADS and DEPTH > 0, BYTES >= PART");
  int flags = O_RDONLY | O_CLOEXEC;
  if (direct) flags |= O_DIRECT;
  const int fd = ::open(path.c_str(), flags);
  if (fd < 0) fail("cannot open " + path + ": " + std::strerror(errno));
  ck(cudaSetDevice(0), "cudaSetDevice");
  unsigned char* dev = nullptr;
  ck(cudaMalloc(&dev, bytes), "cudaMalloc (destination)");
  const std::uint64_t parts = bytes / part;
  unsigned char* host_arena = nullptr;  // --arena: the pinned destination of every pread
  if (arena) {
    void* p = nullptr;
    ck(cudaHostAlloc(&p, bytes, cudaHostAllocDefault), "cudaHostAlloc (arena)");
    std::memset(p, 0, bytes);  // committed before the clock, as the engine's arena is
    host_arena = static_cast<unsigned char*>(p);
  }

  // Per thread: its stream, `depth` pinned buffers, an event per buffer. Made before the clock.
  struct Lane {
    cudaStream_t stream{};
    std::vector<unsigned char*> buf;
    std::vector<cudaEvent_t> done;
  };
  std::vector<Lane> lanes(threads);
  for (Lane& l : lanes) {
    ck(cudaStreamCreateWithFlags(&l.stream, cudaStreamNonBlocking), "cudaStreamCreate");
    for (unsigned d = 0; d < depth; ++d) {
      void* p = nullptr;
      ck(cudaMallocHost(&p, part), "cudaMallocHost");
      std::memset(p, 0, part);
      cudaEvent_t e;
      ck(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
      l.buf.push_back(static_cast<unsigned char*>(p));
      l.done.push_back(e);
    }
  }
  std::atomic<std::uint64_t> next{0}, moved{0};
  // Where a part's time goes, summed over the threads (ns): waiting for the buffer's previous
  // copy, the pread, and queueing the copy and its event.
  std::atomic<std::uint64_t> wait_ns{0}, pread_ns{0}, issue_ns{0};
  std::atomic<int> error{0};
  auto worker = [&](Lane& l) {
    std::uint64_t mine = 0, waited = 0, read = 0, issued = 0;
    unsigned use = 0;
    std::vector<bool> busy(depth, false);
    for (std::uint64_t j; (j = next.fetch_add(1, std::memory_order_relaxed)) < parts;) {
      const auto t0 = Clock::now();
      if (!arena && busy[use] && cudaEventSynchronize(l.done[use]) != cudaSuccess) {
        error.store(-2);
        return;
      }
      const auto t1 = Clock::now();
      unsigned char* b = arena ? host_arena + j * part : l.buf[use];
      std::uint64_t got = 0;
      while (got < part) {
        const ssize_t n = ::pread(fd, b + got, part - got, off_t(offset + j * part + got));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
          error.store(n < 0 ? errno : -1);
          return;
        }
        got += std::uint64_t(n);
      }
      const auto t2 = Clock::now();
      if (cudaMemcpyAsync(dev + j * part, b, part, cudaMemcpyHostToDevice, l.stream) !=
              cudaSuccess ||
          cudaEventRecord(l.done[use], l.stream) != cudaSuccess) {
        error.store(-2);
        return;
      }
      busy[use] = true;
      use = (use + 1) % depth;
      mine += got;
      const auto t3 = Clock::now();
      waited += std::uint64_t(std::chrono::nanoseconds(t1 - t0).count());
      read += std::uint64_t(std::chrono::nanoseconds(t2 - t1).count());
      issued += std::uint64_t(std::chrono::nanoseconds(t3 - t2).count());
    }
    if (cudaStreamSynchronize(l.stream) != cudaSuccess) error.store(-2);
    moved.fetch_add(mine);
    wait_ns.fetch_add(waited);
    pread_ns.fetch_add(read);
    issue_ns.fetch_add(issued);
  };
  const auto t0 = Clock::now();
  std::vector<std::thread> pool;
  for (Lane& l : lanes) pool.emplace_back(worker, std::ref(l));
  for (auto& t : pool) t.join();
  const double seconds = seconds_since(t0);
  if (error.load() != 0) fail("a read or copy failed: " + std::to_string(error.load()));
  const double h2d = pinned_h2d(std::size_t(1) << 28);
  std::printf(
      "{\"bytes\": %llu, \"seconds\": %.6f, \"gb_s\": %.3f, \"pinned_h2d_gb_s\": %.3f, "
      "\"part_bytes\": %llu, \"threads\": %u, \"depth\": %u, \"direct\": %s, "
      "\"arena\": %s, \"us_a_part\": {\"wait\": %.1f, \"pread\": %.1f, \"issue\": %.1f}}\n",
      (unsigned long long)moved.load(), seconds, moved.load() / seconds / 1e9, h2d / 1e9,
      (unsigned long long)part, threads, depth, direct ? "true" : "false",
      arena ? "true" : "false", 1e-3 * double(wait_ns.load()) / double(parts),
      1e-3 * double(pread_ns.load()) / double(parts), 1e-3 * double(issue_ns.load()) / double(parts));
  for (Lane& l : lanes) {
    for (auto* b : l.buf) cudaFreeHost(b);
    for (auto e : l.done) cudaEventDestroy(e);
    cudaStreamDestroy(l.stream);
  }
  cudaFree(dev);
  if (host_arena) cudaFreeHost(host_arena);
  ::close(fd);
  return 0;
}
