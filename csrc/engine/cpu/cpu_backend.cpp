// The CPU backend: a device thread runs submitted command lists in order and blocks on event
// waits exactly as a GPU would, concurrently with the host and the IO threads (the queue is
// exec/queued_backend.h's); kernels fan out over a small worker pool. This is the reference
// every other backend is checked against.
#include <algorithm>
#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <thread>

#include "exec/queued_backend.h"
#include "common/check.h"
#include "cpu/cpu_kernels.h"
#include "cpu/mlx_kernels.h"
#include "cpu/worker_pool.h"

namespace strata {
namespace {

class CpuBackend final : public QueuedBackend<> {
 public:
  explicit CpuBackend(unsigned threads)
      : QueuedBackend("strata-device"),
        pool_(threads > 1 ? threads - 1 : 0),
        pf_([this](std::uint32_t n, const std::function<void(std::uint32_t, std::uint32_t)>& fn) {
          pool_.run(n, fn);
        }) {
    start();
  }

  ~CpuBackend() override { stop(); }

  std::string name() const override { return "cpu"; }
  // The device thread needs the cores, so the host's spin is short: 50 us covers a small decode
  // layer's answer (the serving load test's model, a 1-row step: benchmarks/batch_step.py
  // measures what the spin saves). Where answers take longer (a batch of rows, a prompt) the
  // Window stops spinning (exec/adaptive_spin.h).
  std::chrono::microseconds host_spin() const override { return std::chrono::microseconds(50); }

  // The reference runs everything on host memory: moce, per-entry outputs (y is the host's
  // scratch), and MLX's arithmetic for the formats MLX computes so.
  std::optional<std::string> unsupported(const Capability& c) const override {
    if (c.io != Io::Host)
      return "the cpu backend reads x from and writes out to host memory only (device "
             "pointers need the cuda backend)";
    if (c.arithmetic == Arithmetic::Float32 || !c.layout) return std::nullopt;
    const char* why = cpu::mlx::unsupported(*c.layout, c.arithmetic, c.format_class);
    return *why ? std::optional<std::string>(why) : std::nullopt;
  }

 private:
  // CPU memory is already shared with the host: nothing to wrap. The device thread reads b_
  // only after it takes its next command under the queue's lock, which orders this store.
  void bind_idle(const DeviceBuffers& buffers) override { b_ = buffers; }

  std::string execute(const QueuedCommand& item) override {
    const Command& c = item.c;
    const DeviceBuffers& b = b_;
    const cpu::ParallelFor& pf = pf_;
    switch (c.op) {
      case Op::Route:
        cpu::route(b, c.layer, c.rows, b.ids, b.weights, pf, c.moce);
        return "";
      case Op::RoutePredict:
        cpu::route(b, c.layer, c.rows, b.pred_ids[c.distance - 1], nullptr, pf);
        return "";
      case Op::Plan:
        cpu::plan(b, c.layer, c.rows);
        return "";
      case Op::GateUp:
        return cpu::gate_up(b, c.layer, c.rows, c.pass, pf, c.rounding) ? "" : absent(c);
      case Op::Down:
        return cpu::down(b, c.layer, c.rows, c.pass, pf, c.rounding) ? "" : absent(c);
      case Op::MoeMM:
        return cpu::moe_mm(b, c.layer, c.rows, pf, c.rounding) ? "" : absent(c);
      case Op::Combine:
        cpu::combine(b, c.rows, pf);
        return "";
      case Op::Signal:
        c.event->signal(c.value);
        return "";
      case Op::Wait:
        c.event->wait(c.value);
        return "";
    }
    return "unknown op";
  }

  static std::string absent(const Command& c) {
    return "device: an expert of layer " + std::to_string(c.layer) +
           " has no published slot when its pass runs (handshake bug)";
  }

  cpu::WorkerPool pool_;  // the device thread's fork-join
  const cpu::ParallelFor pf_;
  DeviceBuffers b_;  // bind_idle() while the device thread is idle; the device thread's after
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(unsigned threads) {
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
  return std::make_unique<CpuBackend>(threads);
}

}  // namespace strata
