// The backend interface: what a device (the CPU reference, or Metal on macOS) provides to the
// Window. Buffers are bound once, without copies; commands carry only scalars and run in
// submission order; SharedEvents let a submission wait for the host and the host wait for it.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "policy/moce.h"
#include "pack/pack_file.h"
#include "exec/shared_event.h"
#include "residency/record_observer.h"

namespace strata {

// Everything a kernel may touch. Host and device share these bytes (CPU memory here; on macOS
// no-copy MTLBuffers over the same pages).
struct DeviceBuffers {
  const PackLayout* layout = nullptr;
  const unsigned char* arena = nullptr;  // n_slots x record_stride
  std::uint64_t slot_bytes = 0;
  std::uint32_t n_slots = 0;
  const std::uint32_t* smap = nullptr;  // n_layers * n_experts, read with acquire loads
  const float* routers = nullptr;       // [n_layers][n_experts][hidden]
  // Scratch, sized for max_rows tokens.
  std::uint32_t max_rows = 0;
  float* x = nullptr;                // [max_rows, hidden] layer input
  std::int32_t* ids = nullptr;       // [max_rows, top_k] routed experts
  float* weights = nullptr;          // [max_rows, top_k] their mixture weights
  std::int32_t* pred_ids[2] = {};    // [max_rows, top_k] router l+1 / l+2 on layer l's input
  float* logits = nullptr;           // [max_rows, n_experts] router scratch (reused by every route)
  std::uint32_t* plan = nullptr;     // [max_rows, top_k] slot snapshot, ABSENT = missing
  float* h = nullptr;                // [max_rows * top_k, moe_intermediate]
  float* y = nullptr;                // [max_rows * top_k, hidden] weighted expert outputs
  float* out = nullptr;              // [max_rows, hidden]
  std::int32_t* wave = nullptr;      // [n_experts] experts of the current prompt wave
  std::uint32_t* wave_n = nullptr;   // [1] how many: written by the host before each release
  // moce (written by Route only when a mode is on): per token, the true probability mass and
  // the number of true top-k experts it dropped, and the residency it read from smap.
  float* moce_moved = nullptr;              // [max_rows]
  std::uint32_t* moce_changed = nullptr;    // [max_rows]
  std::uint32_t* route_resident = nullptr;  // [n_experts] 1 = smap held a slot for it
};

enum class Op : std::uint8_t {
  Route,         // ids, weights <- route(x, router[layer]), adjusted by moce when it is on
  RoutePredict,  // pred_ids[distance-1] <- top-k of router[layer] on x (layer = l + distance)
  Plan,          // plan <- smap snapshot of every routed expert
  GateUp,        // h <- silu(gate x) * (up x) for entries of one plan class (pass)
  Down,          // y <- w * (down h) for the same entries
  MoeMM,         // gate_up + down grouped per expert, for the *wave_n experts listed in `wave`
  Combine,       // out[t] <- sum_j y[t, j], in j order (deterministic)
  Signal,        // event <- value
  Wait,          // block until event >= value
};

enum class Pass : std::uint8_t { Resident = 0, Missing = 1 };

// How the expert passes (GateUp, Down, MoeMM) round. Float32: every output element is one
// float32 dot product, rounded once: the fastest and the most exact. MlxBfloat16 / MlxFloat32:
// the operation order and roundings of MLX's CPU kernels for activations of that dtype
// (quantized matmul accumulating in that dtype, its exp and sigmoid, each elementwise op
// rounded), so a model mlx-lm evaluates on the CPU gets bitwise its own numbers. Only the CPU
// backend implements them; a routed call asks for them (Window::Routed::rounding).
enum class Arithmetic : std::uint8_t { Float32 = 0, MlxBfloat16 = 1, MlxFloat32 = 2 };
struct Rounding {
  Arithmetic arithmetic = Arithmetic::Float32;
  // Mlx modes: the model's mixture weights are bfloat16, so each weighted expert output is
  // rounded to bfloat16 before the (float32) sum; float32 weights give a float32 product.
  bool weights_bf16 = false;
};

struct Command {
  Op op;
  std::uint32_t layer = 0;
  std::uint32_t rows = 0;      // T
  std::uint32_t distance = 0;  // RoutePredict: 1 or 2
  Pass pass = Pass::Resident;
  SharedEvent* event = nullptr;
  std::uint64_t value = 0;
  MoceParams moce;  // Route: cache-aware routing (off: exact top-k)
  Rounding rounding;  // GateUp, Down, MoeMM
  // Signal: raise the event once everything before it is queued on the device, not finished
  // (a chunk whose caller's stream waits for its output: DeviceIo::ordered). Only a backend
  // whose completes_async() is true honours it; any other signals after the work, as always.
  bool queued = false;
};

// Where a routed call's x and out live. Host: the Window copies x into its scratch and out
// from it (every backend). Device: they are the caller's memory on the backend's device (a
// torch CUDA tensor, say), which the backend reads and writes itself (set_device_io).
enum class Io : std::uint8_t { Host = 0, Device = 1 };

// One thing a Window may ask a backend to run, by type (ggml's supports_op): an op on a pack's
// layout, with the arithmetic of its expert passes, the mode of its route and where its
// input and output live.
struct Capability {
  Op op = Op::GateUp;
  const PackLayout* layout = nullptr;  // the pack (weight format, group size, biases, ...)
  Arithmetic arithmetic = Arithmetic::Float32;  // GateUp, Down, MoeMM
  MoceMode moce = MoceMode::Off;                // Route
  Io io = Io::Host;                             // Combine (out) and the passes (x)
  // GateUp, Down, MoeMM on a pack whose formats differ by layer (PackLayout::mixed()): the
  // format class of the layers asked about; -1 asks about every class.
  std::int32_t format_class = -1;
  // Combine: the host reads each entry's weighted output from the bound y scratch once the
  // chunk is done, instead of (or besides) the sum over k in out: a routed call that returns
  // [rows, top_k, hidden] (Window::Routed::per_entry), as an experts module does.
  bool per_entry = false;
};

// Io::Device: the caller's device memory for the rows of the chunk being submitted, float32,
// row-major [rows, hidden]: the passes read x there, Combine writes out there. Null: the bound
// scratch (DeviceBuffers::x, ::out), as for Io::Host.
struct DeviceIo {
  const float* x = nullptr;
  float* out = nullptr;
  // The caller's stream on the device (a cudaStream_t for the cuda backend; 0 is the legacy
  // default stream, so `ordered` says whether one is given). With it, a queued Signal
  // (Command::queued) makes `stream` wait on the device for everything submitted before it:
  // work the caller queues there afterwards reads out complete, and x stays unchanged for the
  // backend's kernels (the caller writes it only on that stream), with no host wait.
  bool ordered = false;
  std::uintptr_t stream = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  // Its tuning as read when it was made (docs/settings.md, "Tuning"), in words; "" for none.
  virtual std::string tuning() const { return {}; }
  // Why this backend cannot run `c`, or nullopt when it can. The Window asks at construction,
  // once per capability it may need, and refuses by this reason when a call needs one that is
  // missing. Every backend runs every op in Float32 without moce on host memory; by default
  // nothing more.
  virtual std::optional<std::string> unsupported(const Capability& c) const {
    if (c.layout && c.layout->mixed())
      return "the " + name() + " backend computes packs whose experts share one format; this "
             "pack's differ by layer or matrix (the cpu backend computes it)";
    if (c.io != Io::Host)
      return "the " + name() + " backend reads x from and writes out to host memory only "
             "(device pointers need the cuda backend)";
    if (c.arithmetic != Arithmetic::Float32)
      return "the " + name() + " backend computes in float32 only";
    if (c.moce != MoceMode::Off)
      return "the " + name() + " backend does not implement cache-aware routing (moce)";
    if (c.per_entry)
      return "the " + name() + " backend keeps expert outputs where the host cannot read them "
             "(no per-entry outputs)";
    return std::nullopt;
  }
  virtual void bind(const DeviceBuffers& buffers) = 0;
  // Io::Device only (a backend whose unsupported() accepts it): the commands submitted from now
  // on read x from io.x and write Combine's out to io.out, until the next call ({}: the bound
  // scratch again). Throws std::invalid_argument when a pointer is not memory of this
  // backend's device. The caller keeps both valid and unchanged until those commands ran.
  virtual void set_device_io(const DeviceIo& io) {
    if (io.x || io.out)
      throw std::logic_error("the " + name() + " backend cannot read or write device memory");
  }
  // What must happen to a record's bytes before the stream may publish it (a device copy:
  // residency/record_observer.h), or null (the default: the device reads the host arena, or
  // copies lazily). The Window registers it with the stream after the first bind() and removes
  // it before the backend goes; the backend owns it.
  virtual RecordObserver* record_observer() { return nullptr; }
  // How long the host may spin on a handshake event before it blocks (Window::wait_device):
  // about how soon this backend's device usually answers, when that is sooner than waking a
  // blocked thread costs. The Window spins only at wait sites whose answers have been coming
  // within it (exec/adaptive_spin.h). Zero: block at once.
  virtual std::chrono::microseconds host_spin() const { return std::chrono::microseconds(0); }
  // Whether a queued Signal (Command::queued) with an ordered DeviceIo may be raised before the
  // kernels before it finish. Then the host learns that they finished only from synchronize(),
  // which the Window calls before anything may reuse what they read (the pending completion:
  // exec/window.h, I4). False (the default): every Signal follows the work before it.
  virtual bool completes_async() const { return false; }
  // Runs asynchronously, in order, after everything submitted before it. The commands are
  // copied: the caller reuses its vector.
  virtual void submit(const std::vector<Command>& commands) = 0;
  // Blocks until every submitted command has run and every kernel it launched has finished; a
  // device error one of them met (an asynchronous fault) is then in take_device_error().
  virtual void synchronize() = 0;
  // Makes the device skip the rest of what is queued (Wait commands included) until
  // synchronize() returns; used when the host abandons a layer call (IO error, Ctrl-C).
  virtual void abort_pending() = 0;
  // A kernel found something impossible (a missing-pass expert still absent from smap):
  // returns and clears the message, "" when none.
  virtual std::string take_device_error() = 0;
};

// What every backend factory is given (exec/backend_registry.h). A backend uses what applies.
struct BackendOptions {
  unsigned threads = 0;      // CPU kernel threads, 0 = one per core
  std::string library_path;  // Metal: the compiled kernels (empty: beside the binary)
};

std::unique_ptr<Backend> make_cpu_backend(unsigned threads = 0);

}  // namespace strata
