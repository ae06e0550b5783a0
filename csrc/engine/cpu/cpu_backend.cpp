// The CPU backend: a device thread runs submitted command lists in order and blocks on event
// waits exactly as a GPU would, concurrently with the host and the IO threads; kernels fan out
// over a small worker pool. This is the reference every other backend is checked against.
#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "exec/backend.h"
#include "common/check.h"
#include "common/thread_name.h"
#include "cpu/cpu_kernels.h"
#include "cpu/mlx_kernels.h"
#include "cpu/worker_pool.h"

namespace strata {
namespace {

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(unsigned threads)
      : pool_(threads > 1 ? threads - 1 : 0), device_([this] {
          name_this_thread("strata-device");
          device_loop();
        }) {}

  ~CpuBackend() override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
      abort_ = true;
    }
    cv_.notify_all();
    device_.join();
  }

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

  void bind(const DeviceBuffers& buffers) override {
    synchronize();
    std::lock_guard<std::mutex> lk(mu_);
    buffers_ = buffers;  // CPU memory is already shared with the host: nothing to wrap
  }

  void submit(const std::vector<Command>& commands) override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      for (auto& c : commands) queue_.push_back(c);
    }
    cv_.notify_all();
  }

  void synchronize() override {
    std::unique_lock<std::mutex> lk(mu_);
    idle_cv_.wait(lk, [&] { return queue_.empty() && !running_; });
    abort_ = false;
  }

  void abort_pending() override {
    SharedEvent* ev;
    std::uint64_t v;
    {
      std::lock_guard<std::mutex> lk(mu_);
      abort_ = true;
      ev = parked_event_;
      v = parked_value_;
    }
    // A device thread parked on a Wait must wake: its event gets the value it waits for.
    if (ev) ev->signal(v);
    cv_.notify_all();
  }

  std::string take_device_error() override {
    std::lock_guard<std::mutex> lk(mu_);
    std::string e;
    e.swap(error_);
    return e;
  }

 private:
  void device_loop() {
    cpu::ParallelFor pf = [this](std::uint32_t n,
                                 const std::function<void(std::uint32_t, std::uint32_t)>& fn) {
      pool_.run(n, fn);
    };
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
      if (stop_ && queue_.empty()) return;
      Command c = queue_.front();
      queue_.pop_front();
      if (abort_) {  // skip everything until the host synchronizes
        if (queue_.empty()) idle_cv_.notify_all();
        continue;
      }
      running_ = true;
      if (c.op == Op::Wait) {
        parked_event_ = c.event;
        parked_value_ = c.value;
      }
      DeviceBuffers b = buffers_;
      lk.unlock();
      std::string err = execute(c, b, pf);
      lk.lock();
      parked_event_ = nullptr;
      running_ = false;
      if (!err.empty() && error_.empty()) error_ = err;
      if (queue_.empty()) idle_cv_.notify_all();
    }
  }

  std::string execute(const Command& c, const DeviceBuffers& b, const cpu::ParallelFor& pf) {
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

  cpu::WorkerPool pool_;
  std::mutex mu_;
  std::condition_variable cv_;       // commands queued or stopping
  std::condition_variable idle_cv_;  // queue drained
  std::deque<Command> queue_;        // mu_
  DeviceBuffers buffers_;            // mu_ (copied by the device thread per command)
  bool running_ = false;             // mu_: a command is executing
  bool abort_ = false;               // mu_: skip queued commands until synchronize()
  bool stop_ = false;                // mu_
  SharedEvent* parked_event_ = nullptr;  // mu_: the event a running Wait blocks on
  std::uint64_t parked_value_ = 0;       // mu_
  std::string error_;                // mu_
  std::thread device_;               // last: starts after every field above exists
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(unsigned threads) {
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
  return std::make_unique<CpuBackend>(threads);
}

}  // namespace strata
