#include "cuda_backend.h"

#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <deque>
#include <algorithm>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <unordered_set>
#include <thread>
#include <tuple>
#include <vector>

#include "arena_mirror.h"
#include "common/env.h"
#include "bf16_families.h"
#include "cuda_check.h"
#include "device_memory.h"
#include "host_registry.h"
#include "kernels/kernels.h"
#include "kernels/mma_experts.h"
#include "exec/queued_backend.h"
#include "residency/smap.h"

namespace strata::cuda {
namespace {

DevLayout device_layout(const PackLayout& L, std::uint32_t plant) {
  DevLayout d;
  d.n_experts = L.n_experts;
  d.top_k = L.top_k;
  d.hidden = L.hidden;
  d.inter = L.moe_intermediate;
  d.routing = std::uint32_t(L.routing);
  d.norm_topk = L.norm_topk_prob ? 1 : 0;
  d.format = std::uint32_t(L.weight_format);
  d.group_size = L.group_size;
  d.scale_format = L.scale_format;
  d.bias_format = L.bias_format;
  d.activation = std::uint32_t(L.activation);
  d.act_alpha = L.act_alpha;
  d.act_limit = L.act_limit;
  for (const TensorEntry& t : L.tensors) {
    DevMatrix& m = d.m[t.matrix];
    if (t.role == 0) m.weight = t.offset;
    if (t.role == 1) m.scales = t.offset;
    if (t.role == 2) m.biases = t.offset;
    if (t.role == kRoleBias) m.bias = t.offset;
    m.rows = t.matrix == 2 ? L.hidden : L.moe_intermediate;
    m.cols = t.matrix == 2 ? L.moe_intermediate : L.hidden;
  }
  d.plant = plant;  // Tuning::plant
  return d;
}

// How long the device thread spins before it blocks on a condition variable: a thread woken
// from a futex costs tens of microseconds on a virtual machine, more than a whole decode layer's
// kernels; spinning this long costs one core at most that long.
constexpr auto kSpin = std::chrono::microseconds(200);

// A queued command and the facts of the submission it came in. A Route carries the
// RoutePredict commands that follow it in its submission: one launch runs them all.
struct Item {
  Command c{};
  std::uint32_t n_fused = 0;
  Command fused[kMaxRouteTasks - 1];  // RoutePredict commands folded into this Route
  bool batch_start = false;
  bool batch_routes = false;     // the submission routes on the device (else the host did)
  std::uint32_t batch_rows = 0;  // the largest row count among its commands
  DeviceIo io;                   // the caller's device x / out at submission (set_device_io)
};

// Why `p` cannot be a routed call's float32 rows on device 0 ("" when it can): the one check
// that needs CUDA, made once per chunk on the host thread (cudaPointerGetAttributes, no sync).
std::string device_pointer_problem(const void* p, const char* what) {
  if (!p) return std::string(what) + " is a null pointer";
  if (reinterpret_cast<std::uintptr_t>(p) % alignof(float) != 0)
    return std::string(what) + " is not aligned for float32";
  cudaPointerAttributes a{};
  const cudaError_t e = cudaPointerGetAttributes(&a, p);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return std::string(what) + " is not CUDA memory (" + cudaGetErrorName(e) + ")";
  }
  if (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged)
    return std::string(what) + " is host memory, not memory of CUDA device 0";
  if (a.device != 0)
    return std::string(what) + " is memory of CUDA device " + std::to_string(a.device) +
           "; the cuda backend runs on device 0";
  return "";
}

// Where the kernels read experts (Tuning::arena).
//   Device (default): a device-memory mirror of the arena, slot for slot (arena_mirror.h),
//     filled at IO completion on copy streams before the stream publishes a record, so the
//     kernels read HBM; a published slot whose mirror holds another key (read before this
//     backend registered) is copied by the device thread before the pass, on its stream.
//   Mapped: the kernels read the host arena itself through the mapping (over PCIe).
enum class ArenaMode : std::uint8_t { Device, Mapped };

// How the device mirror is filled (Tuning::fill), at IO completion, on copy streams, before
// publication (arena_mirror.h):
//   parts (default): the record copied in chunks of parts (Tuning::copy_chunk_bytes) as their
//     parts land, beside the record's other parts' reads, which shortens a miss
//     (benchmarks/miss_latency.py --backend cuda measures it);
//   completion: the whole record copied after its last part.
// A published slot whose mirror holds another key (read before this backend registered) is
// copied by the device thread before the pass that reads it, either way.
enum class MirrorFill : std::uint8_t { Parts, Completion };

// How much of a record one mirror copy takes with the parts fill: as many consecutive parts as
// fit this, at least one; 0 copies each part alone. 1 MiB by default: the copy engine's fixed
// cost a copy is then small beside the copy's bytes (benchmarks/native/cuda_copy_engine.cu
// measures that cost).
constexpr std::uint64_t kCopyChunkKib = 1024;

// The backend's tuning: read once, through common/env.h, when a backend is made; printed to
// stderr then when STRATA_CUDA_TRACE is set, and by tuning_description(). For benchmarks and
// tests, not users (docs/settings.md, "Tuning").
struct Tuning {
  ArenaMode arena = ArenaMode::Device;                  // STRATA_CUDA_ARENA: device | mapped
  MirrorFill fill = MirrorFill::Parts;                  // STRATA_CUDA_MIRROR_FILL: parts | completion
  std::uint64_t copy_chunk_bytes = kCopyChunkKib << 10;  // STRATA_CUDA_COPY_CHUNK_KIB: 0..65536
  Bf16Family bf16 = Bf16Family::Auto;                   // STRATA_CUDA_BF16: auto | mma | wgmma
  // STRATA_CUDA_TEST_PLANT: gate_up | route, a planted kernel error the parity tests must catch
  // (device_types.h; only in a build with STRATA_CUDA_PLANT).
  std::uint32_t plant = 0;
  bool trace = false;  // STRATA_CUDA_TRACE set: per-command times printed when the backend goes

  static Tuning from_env() {
    Tuning t;
    t.arena = env::choice("STRATA_CUDA_ARENA", {"device", "mapped"}) == 0 ? ArenaMode::Device
                                                                         : ArenaMode::Mapped;
    t.fill = env::choice("STRATA_CUDA_MIRROR_FILL", {"parts", "completion"}) == 0
                 ? MirrorFill::Parts
                 : MirrorFill::Completion;
    t.copy_chunk_bytes =
        std::uint64_t(env::integer("STRATA_CUDA_COPY_CHUNK_KIB", kCopyChunkKib, 0, 65536, "KiB"))
        << 10;
    t.bf16 = bf16_family_asked();
    if (env::text("STRATA_CUDA_TEST_PLANT")) {
      const std::size_t p = env::choice("STRATA_CUDA_TEST_PLANT", {"gate_up", "route"});
      t.plant = p == 0 ? kPlantGateUp : kPlantRoute;
    }
    t.trace = env::present("STRATA_CUDA_TRACE");
    return t;
  }

  // One line, the variables' names and values, as the environment would set them.
  std::string describe() const {
    const char* bf16_name = bf16 == Bf16Family::Mma     ? "mma"
                            : bf16 == Bf16Family::Wgmma ? "wgmma"
                                                        : "auto";
    return std::string("STRATA_CUDA_ARENA=") + (arena == ArenaMode::Device ? "device" : "mapped") +
           " STRATA_CUDA_MIRROR_FILL=" + (fill == MirrorFill::Parts ? "parts" : "completion") +
           " STRATA_CUDA_COPY_CHUNK_KIB=" + std::to_string(copy_chunk_bytes >> 10) +
           " STRATA_CUDA_BF16=" + bf16_name +
           " STRATA_CUDA_TEST_PLANT=" +
           (plant == kPlantGateUp ? "gate_up" : plant == kPlantRoute ? "route" : "off") +
           " STRATA_CUDA_TRACE=" + (trace ? "1" : "0");
  }
};

class CudaBackend final : public QueuedBackend<Item> {
 public:
  CudaBackend() : CudaBackend(Tuning::from_env()) {}
  explicit CudaBackend(const Tuning& tuning)
      : QueuedBackend("strata-cuda", kSpin),
        tuning_(tuning),
        mode_(tuning.arena),
        spin_(idle_spin()),
        trace_(tuning.trace) {
    if (trace_) std::fprintf(stderr, "strata cuda tuning: %s\n", tuning_.describe().c_str());
    mirror_.copy_parts(tuning_.fill == MirrorFill::Parts, tuning_.copy_chunk_bytes);
    arena_ = make_arena_strategy();
    cuda_check(cudaSetDevice(0), "cudaSetDevice");
    bf16_asked_ = tuning_.bf16;
    cuda_check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    void* p = nullptr;
    cuda_check(cudaHostAlloc(&p, sizeof(DevError), cudaHostAllocMapped | cudaHostAllocPortable),
               "cudaHostAlloc");
    err_host_ = static_cast<DevError*>(p);
    std::memset(err_host_, 0, sizeof(DevError));
    cuda_check(cudaHostGetDevicePointer(&p, err_host_, 0), "cudaHostGetDevicePointer");
    dev_.error = static_cast<DevError*>(p);
    cuda_check(cudaEventCreateWithFlags(&queued_done_, cudaEventDisableTiming), "cudaEventCreate");
    start();
  }

  ~CudaBackend() override {
    stop();
    cudaStreamSynchronize(stream_);
    if (trace_) print_trace();
    for (auto& [start, end] : crossings_) {
      cudaEventDestroy(start);
      if (end) cudaEventDestroy(end);
    }
    unmap();
    cudaFreeHost(err_host_);
    cudaEventDestroy(queued_done_);
    cudaStreamDestroy(stream_);
    cudaGetLastError();
  }

  std::string name() const override { return "cuda"; }
  std::string tuning() const override { return tuning_.describe(); }
  // The device thread answers a handshake in tens of microseconds, about what waking a blocked
  // host thread costs on a virtual machine: the host spins as that thread does.
  std::chrono::microseconds host_spin() const override { return spin_; }

  // Float32 without moce, as every backend, on host memory or on the caller's device memory.
  std::optional<std::string> unsupported(const Capability& c) const override {
    Capability host = c;
    host.io = Io::Host;
    return Backend::unsupported(host);
  }

  void set_device_io(const DeviceIo& io) override {
    if (io.x || io.out) {  // {}: the scratch again
      std::string why = device_pointer_problem(io.x, "x");
      if (why.empty()) why = device_pointer_problem(io.out, "out");
      if (why.empty() && io.ordered) why = stream_problem(io.stream);
      if (!why.empty()) throw std::invalid_argument("cuda: " + why);
    }
    store_device_io(io);
  }
  ArenaMode mode() const { return mode_; }

  // The arena strategy's answers (DeviceArena, MappedArena).
  bool completes_async() const override { return arena_->completes_async(); }
  RecordObserver* record_observer() override { return arena_->observer(); }

  // The device thread is idle and waits for the queue's lock, which bind() holds.
  void bind_idle(const DeviceBuffers& b) override {
    cudaSetDevice(0);
    const PackLayout& L = *b.layout;
    layout_ = device_layout(L, tuning_.plant);
    // Which bf16 family: settled here, at the first bind of a bf16 pack (the known-answer check
    // launches kernels of its own, on its own stream; the device thread is idle).
    if (layout_.format == 2 && !bf16_family_)
      bf16_family_ = bf16_family_settled(bf16_asked_, nullptr);
    layout_.bf16_wgmma = std::uint32_t(bf16_family_.value_or(Bf16Family::Mma));
    if (layout_.top_k > 64)
      throw std::runtime_error("the cuda backend routes at most top-64, the pack has top-" +
                               std::to_string(L.top_k));
    cuda_check(prepare_kernels(layout_),
               "cudaFuncSetAttribute (shared memory for the hidden size)");
    cuda_check(prepare_route(layout_),
               "cudaFuncSetAttribute (route: shared memory for the hidden size)");
    map_arena(b, L);
    n_experts_ = L.n_experts;
    dev_.slot_bytes = b.slot_bytes;
    dev_.n_slots = b.n_slots;
    copy_routers(b, L);
    bind_scratch(b.max_rows, L);
    host_ = b;
  }

  // The stream's arena and slot map: mapped once, in place (the IO threads write them); the
  // kernels read the arena the strategy says.
  void map_arena(const DeviceBuffers& b, const PackLayout& L) {
    if (b.arena != host_arena_) {
      unmap();
      std::string why;
      const std::size_t arena_bytes = std::size_t(b.n_slots) * b.slot_bytes;
      void* a = map_host(b.arena, arena_bytes, &why);
      if (!a) throw std::runtime_error("cuda: mapping the arena into the GPU: " + why);
      host_arena_ = b.arena;
      // smap: page-aligned and page-rounded (ExpertStream), so whole pages are registered.
      const std::size_t smap_bytes = (std::size_t(L.n_keys()) * 4 + kPage - 1) / kPage * kPage;
      void* s = map_host(b.smap, smap_bytes, &why);
      if (!s) {
        unmap();
        throw std::runtime_error("cuda: mapping the slot map into the GPU: " + why);
      }
      host_smap_ = b.smap;
      dev_.smap = static_cast<const std::uint32_t*>(s);
      dev_.arena = arena_->bind_arena(b, L, static_cast<const unsigned char*>(a));
    }
  }

  // Routers: copied once (the Window reads them once from the pack and keeps them).
  void copy_routers(const DeviceBuffers& b, const PackLayout& L) {
    const std::size_t router_bytes = L.has_routers() && b.routers
                                         ? std::size_t(L.n_layers) * L.n_experts * L.hidden * 4
                                         : 0;
    if (router_bytes && b.routers != host_routers_) {
      routers_.ensure(router_bytes);
      cuda_check(cudaMemcpy(routers_.as<void>(), b.routers, router_bytes, cudaMemcpyHostToDevice),
                 "cudaMemcpy (routers)");
      host_routers_ = b.routers;
      dev_.routers = routers_.as<float>();
    }
  }

  // Scratch in device memory, for max_rows rows (grown, never shrunk: I12 bounds it), and the
  // host's staging and readback.
  void bind_scratch(std::uint32_t max_rows, const PackLayout& L) {
    const std::size_t R = max_rows, H = L.hidden, I = L.moe_intermediate, E = L.n_experts,
                      k = L.top_k;
    x_.ensure(R * H * 4);
    ids_.ensure(R * k * 4);
    weights_.ensure(R * k * 4);
    plan_.ensure(R * k * 4);
    h_.ensure(R * k * I * 4);
    // bf16 only: the bf16 pieces of x and h the tensor-core prompt kernels stage (6 bytes an
    // element, split once a pass instead of in every block).
    x_pieces_.ensure(mma_x_pieces_bytes(layout_, std::uint32_t(R)));
    h_pieces_.ensure(mma_h_pieces_bytes(layout_, std::uint32_t(R)));
    // Its counter starts at zero and every split leaves it so (pieces.cuh), like the route's.
    x_rest_.ensure((R + 2) * sizeof(std::uint32_t));
    cuda_check(cudaMemsetAsync(x_rest_.as<void>(), 0, (R + 2) * sizeof(std::uint32_t), stream_),
               "cudaMemsetAsync (x_rest)");
    y_.ensure(R * k * H * 4);
    wave_.ensure(E * 4);
    wave_n_.ensure(4);
    groups_.ensure((1 + 8 * E + R * k) * 4);
    // Staging: what moves up between two drains of the stream, with 256-byte alignment slack.
    // (x, host-routed ids and weights, a wave, and two passes' groups: group_on_host()).
    up_.ensure((R * H + 3 * R * k + E + 1 + 2 * (1 + 8 * E + R * k)) * 4 + 8 * 256);
    // Readback: what the host reads at a Signal, written there by the kernels themselves
    // (ids, weights, the two predictions, out), so a Signal copies nothing on the GPU.
    back_.ensure((4 * R * k + R * H) * 4);
    back_ids_ = 0;
    back_weights_ = back_ids_ + R * k * 4;
    back_pred_[0] = back_weights_ + R * k * 4;
    back_pred_[1] = back_pred_[0] + R * k * 4;
    back_out_ = back_pred_[1] + R * k * 4;
    dev_.x = x_.as<float>();
    dev_.ids = ids_.as<std::int32_t>();
    dev_.weights = weights_.as<float>();
    // Predictions and out are read by the host alone: the kernels write them to it directly.
    dev_.pred_ids[0] = back_.device<std::int32_t>(back_pred_[0]);
    dev_.pred_ids[1] = back_.device<std::int32_t>(back_pred_[1]);
    // The route kernel's logits and blocks-done counters (kernels.h): the counters start at
    // zero and every launch leaves them so. Zeroed on the kernels' stream (a non-blocking one,
    // which a plain cudaMemset on the default stream would not order before them).
    logits_.ensure(route_scratch_floats(layout_, std::uint32_t(R)) * 4);
    route_done_.ensure(route_counters(std::uint32_t(R)) * 4);
    cuda_check(cudaMemsetAsync(route_done_.as<void>(), 0, route_counters(std::uint32_t(R)) * 4,
                               stream_),
               "cudaMemsetAsync (route counters)");
    point_scratch();
  }

  // dev_'s scratch pointers into the arrays bind_scratch() sized.
  void point_scratch() {
    const std::size_t E = n_experts_;
    dev_.logits = logits_.as<float>();
    dev_.route_done = route_done_.as<std::uint32_t>();
    dev_.plan = plan_.as<std::uint32_t>();
    dev_.h = h_.as<float>();
    dev_.x_pieces = layout_.format == 2 ? x_pieces_.as<std::uint16_t>() : nullptr;
    dev_.h_pieces = layout_.format == 2 ? h_pieces_.as<std::uint16_t>() : nullptr;
    dev_.x_rest = layout_.format == 2 ? x_rest_.as<std::uint32_t>() : nullptr;
    dev_.y = y_.as<float>();
    dev_.out = back_.device<float>(back_out_);
    dev_.wave = wave_.as<std::int32_t>();
    dev_.wave_n = wave_n_.as<std::uint32_t>();
    std::uint32_t* g = groups_.as<std::uint32_t>();
    dev_.groups_n = g;
    dev_.group_slot = g + 1;
    dev_.group_start = g + 1 + E;
    dev_.group_count = g + 1 + 2 * E;
    dev_.expert_count = g + 1 + 3 * E;
    dev_.expert_cursor = g + 1 + 4 * E;
    dev_.expert_first = g + 1 + 5 * E;
    dev_.in_wave = g + 1 + 6 * E;
    dev_.group_entries = g + 1 + 8 * E;
  }

  // One launch per Route and the RoutePredicts after it in the same submission (the queue's
  // lock is held: the device thread has not taken this submission's items).
  void enqueue(const std::vector<Command>& commands, const DeviceIo& io,
               std::deque<Item>& queue) override {
    Item meta;
    for (const Command& c : commands) {
      if (c.op == Op::Route) meta.batch_routes = true;
      if (c.rows > meta.batch_rows) meta.batch_rows = c.rows;
    }
    meta.io = io;
    bool first = true;
    for (const Command& c : commands) {
      if (c.op == Op::RoutePredict && !first && queue.back().c.op == Op::Route &&
          queue.back().c.rows == c.rows && queue.back().n_fused + 1 < kMaxRouteTasks) {
        Item& route = queue.back();  // this submission's: the device thread has not taken it
        route.fused[route.n_fused++] = c;
        continue;
      }
      Item it = meta;
      it.c = c;
      it.batch_start = first;
      first = false;
      queue.push_back(it);
    }
  }

  // Kernels launched before an abort may still run: none may read a slot the host recycles
  // next (I4, I5), so the stream drains too. An error word they set is kept for the host.
  std::string drained() override {
    const cudaError_t e = cudaStreamSynchronize(stream_);
    std::string err = e != cudaSuccess ? cuda_message("stream", e) : "";
    std::string flagged = read_error_word();
    dirty_ = {};  // an aborted layer's readback is not delivered
    up_used_ = 0;
    return err.empty() ? flagged : err;
  }

  void skipped(const Item&) override { dirty_ = {}; }
  void device_thread_started() override { cudaSetDevice(0); }

 private:
  void unmap() {
    if (host_arena_) unmap_host(host_arena_);
    if (host_smap_) unmap_host(host_smap_);
    host_arena_ = nullptr;
    host_smap_ = nullptr;
  }

  // What the host reads, written on the device since the last Signal.
  struct Dirty {
    std::uint32_t ids_rows = 0, pred_rows[2] = {0, 0}, out_rows = 0;
    bool empty() const { return !ids_rows && !pred_rows[0] && !pred_rows[1] && !out_rows; }
  };

  // Uploads go through pinned staging (pageable copies synchronise and stage in the driver):
  // an upload's bytes are copied into the staging at this point of the device thread (after
  // the submission or the release), so it carries the host's values of that moment; staging is
  // reused only after the stream drained (settle(), synchronize()). stage() returns the staged
  // bytes' device address (a kernel may read them there), or null when they do not fit.
  const void* stage(const void* src, std::size_t bytes) {
    if (up_used_ + bytes > up_.bytes()) {  // full: drain, then start over
      cuda_check(cudaStreamSynchronize(stream_), "upload");
      up_used_ = 0;
    }
    if (bytes > up_.bytes()) return nullptr;
    std::memcpy(up_.as<unsigned char>() + up_used_, src, bytes);
    const void* d = up_.device<const void>(up_used_);
    up_used_ += (bytes + 255) / 256 * 256;
    return d;
  }
  void upload(void* dst, const void* src, std::size_t bytes) {
    if (!bytes) return;
    if (const void* staged = stage(src, bytes)) {
      cuda_check(cudaMemcpyAsync(dst, staged, bytes, cudaMemcpyHostToDevice, stream_), "upload");
      return;
    }
    // Larger than the staging: the driver's own path.
    cuda_check(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), "upload");
  }

  // The device thread's time per command kind (STRATA_CUDA_TRACE), around run().
  std::string execute(const Item& it) override {
    if (!trace_) return run(it);
    const auto t0 = std::chrono::steady_clock::now();
    struct Timed {  // counted on the way out, a throw included
      CudaBackend& self;
      std::size_t op;
      std::chrono::steady_clock::time_point t0;
      ~Timed() {
        self.op_ns_[op] += std::uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                             std::chrono::steady_clock::now() - t0)
                                             .count());
        ++self.op_calls_[op];
      }
    } timed{*this, std::size_t(it.c.op), t0};
    return run(it);
  }

  // The device thread alone touches what follows (bind() runs only when it is idle). One
  // command: a submission's uploads at its first, then the op, dispatched to its function; the
  // ops whose work depends on where the kernels read experts ask the arena strategy (arena_).
  std::string run(const Item& it) {
    const Command& c = it.c;
    // The buffers this command's kernels use: the bound ones, or the caller's device rows
    // (read and written in place: the host thread that made the call waits for them).
    DevBuffers dev = dev_;
    if (it.io.x) dev.x = const_cast<float*>(it.io.x);  // read only: no route stores into it
    if (it.io.out) dev.out = it.io.out;
    const float* x_staged = upload_submission(it);
    const bool regroup = note_command(c);
    switch (c.op) {
      case Op::Route:
        return route(it, dev, x_staged);
      case Op::RoutePredict:
        return route_predict(c, dev);
      case Op::Plan:
        arena_->plan(c, dev);
        return "";
      case Op::GateUp:
      case Op::Down:
        return expert_pass(c, regroup, dev);
      case Op::MoeMM:
        return expert_wave(c, dev);
      case Op::Combine:
        cuda_check(launch_combine(layout_, dev, c.rows, stream_), "combine");
        // Into the caller's device rows: complete at the Signal's drain, nothing to bring back.
        if (!it.io.out) dirty_.out_rows = std::max(dirty_.out_rows, c.rows);
        return "";
      case Op::Signal:
        return signal(it);
      case Op::Wait:
        wait(c);
        return "";
    }
    return "unknown op";
  }

  // A submission's first command brings up what its rows need that the host wrote: x (staged
  // for the route kernel to read and store into dev.x, returned, when that command routes all
  // the rows), and the host's routing when the submission does not route on the device.
  const float* upload_submission(const Item& it) {
    const DeviceBuffers& b = host_;
    if (!it.batch_start || it.batch_rows == 0 || !b.x) return nullptr;
    const std::size_t R = it.batch_rows, H = layout_.hidden, k = layout_.top_k;
    const float* x_staged = nullptr;
    if (it.c.op == Op::Route && it.c.rows == R && !it.io.x)
      x_staged = static_cast<const float*>(stage(b.x, R * H * 4));
    if (!x_staged && !it.io.x) upload(dev_.x, b.x, R * H * 4);
    if (!it.batch_routes) {  // the host routed (or the device did and the host has a copy)
      upload(dev_.ids, b.ids, R * k * 4);
      upload(dev_.weights, b.weights, R * k * 4);
    }
    return x_staged;
  }

  // Notes `c` as the last command; returns whether a pass must group its entries again: not
  // for the Down right after its own GateUp (same pass, layer and rows).
  bool note_command(const Command& c) {
    const bool regroup = !(c.op == Op::Down && last_op_ == Op::GateUp && last_pass_ == c.pass &&
                           last_layer_ == c.layer && last_rows_ == c.rows);
    if (trace_ && c.op != Op::Signal && c.op != Op::Wait) crossing_open_ = false;
    last_op_ = c.op;
    last_pass_ = c.pass;
    last_layer_ = c.layer;
    last_rows_ = c.rows;
    return regroup;
  }

  // Route, with the RoutePredicts folded into it (enqueue): one launch.
  std::string route(const Item& it, const DevBuffers& dev, const float* x_staged) {
    const Command& c = it.c;
    if (c.moce.mode != MoceMode::Off)
      return "the cuda backend does not implement cache-aware routing (moce)";
    RouteTasks tasks;
    tasks.t[tasks.n++] = RouteTask{c.layer, dev_.ids, dev_.weights,
                                   back_.device<std::int32_t>(back_ids_),
                                   back_.device<float>(back_weights_)};
    for (std::uint32_t f = 0; f < it.n_fused; ++f) tasks.t[tasks.n++] = predict_task(it.fused[f]);
    cuda_check(launch_route(layout_, dev, c.rows, tasks, x_staged, stream_), "route");
    dirty_.ids_rows = std::max(dirty_.ids_rows, c.rows);
    return "";
  }

  // A RoutePredict not folded into a Route.
  std::string route_predict(const Command& c, const DevBuffers& dev) {
    RouteTasks tasks;
    tasks.t[tasks.n++] = predict_task(c);
    cuda_check(launch_route(layout_, dev, c.rows, tasks, nullptr, stream_), "route_predict");
    return "";
  }

  // GateUp or Down of a decode pass: its entries grouped by slot (the arena's way), then the
  // kernel. A handshake bug the grouping found is the pass's error; the kernel still runs over
  // the groups that were found (none: it computes nothing).
  std::string expert_pass(const Command& c, bool regroup, DevBuffers& dev) {
    const Grouped g = arena_->group_pass(c, regroup, dev);
    if (!g.launch) return "";
    if (c.op == Op::GateUp)
      cuda_check(launch_gate_up(layout_, dev, c.rows, stream_), "gate_up");
    else
      cuda_check(launch_down(layout_, dev, c.rows, stream_), "down");
    return g.error;
  }

  // MoeMM: a prompt wave's experts grouped (the arena's way), then gate_up and down.
  std::string expert_wave(const Command& c, DevBuffers& dev) {
    const std::string err = arena_->group_wave(c, dev);
    cuda_check(launch_gate_up(layout_, dev, c.rows, stream_), "gate_up");
    cuda_check(launch_down(layout_, dev, c.rows, stream_), "down");
    return err;
  }

  // A Signal: queued (the caller's stream waits on the device), or after a drain that brings
  // the host what it reads.
  std::string signal(const Item& it) {
    const Command& c = it.c;
    if (c.queued && it.io.ordered && completes_async() && dirty_.empty())
      return signal_queued(it);
    if (trace_) open_crossing();
    std::string err = settle();
    c.event->signal(c.value);
    return err;
  }

  void wait(const Command& c) {
    const auto until = std::chrono::steady_clock::now() + spin_;
    while (c.event->value() < c.value && std::chrono::steady_clock::now() < until) {
    }
    c.event->wait(c.value);  // abort_pending() signals it, so this cannot strand
    if (trace_) close_crossing();
  }

  // ---- Where the kernels read experts: one strategy, chosen once ---------------------------
  // The memory mode (STRATA_CUDA_ARENA) is fixed when the backend is made, and completes_async()
  // and record_observer() answer from it before the first bind, so the strategy is chosen in
  // the constructor; every op that depends on the mode asks it (as ggml-cuda dispatches per op)
  // instead of testing the mode inside each.
  struct Grouped {
    bool launch = true;  // false: the pass has no entry and launches nothing
    std::string error;   // a handshake bug the grouping found
  };
  class ArenaStrategy {
   public:
    virtual ~ArenaStrategy() = default;
    // bind(): the arena the kernels read, given the stream's arena mapped into the GPU.
    virtual const unsigned char* bind_arena(const DeviceBuffers& b, const PackLayout& L,
                                            const unsigned char* mapped) = 0;
    // Plan: the snapshot of smap for every routed entry.
    virtual void plan(const Command& c, const DevBuffers& dev) = 0;
    // GateUp / Down: the pass's entries grouped by slot, again only when `regroup`.
    virtual Grouped group_pass(const Command& c, bool regroup, DevBuffers& dev) = 0;
    // MoeMM: the wave's entries grouped by slot; a handshake bug found, or "".
    virtual std::string group_wave(const Command& c, DevBuffers& dev) = 0;
    // Whether a queued Signal may return before the kernels finish (completes_async()).
    virtual bool completes_async() const = 0;
    // The record observer the Window registers (record_observer()), or null.
    virtual RecordObserver* observer() = 0;
  };

  // Device: the kernels read the mirror in device memory. This thread knows every slot a pass
  // reads (it takes the plan itself), mirrors the ones IO completion did not, and groups on the
  // host.
  class DeviceArena final : public ArenaStrategy {
   public:
    explicit DeviceArena(CudaBackend& be) : be_(be) {}
    const unsigned char* bind_arena(const DeviceBuffers& b, const PackLayout& L,
                                    const unsigned char*) override {
      be_.mirror_.allocate(b.n_slots, b.slot_bytes, L.record_bytes);  // nothing mirrored yet
      return be_.mirror_.device();
    }
    // The same snapshot as the plan kernel's, taken here, at the point of the stream where it
    // would run (after release 1): the device thread must know the slots to mirror them. Only
    // this thread reads it: it groups the passes itself (group_on_host).
    void plan(const Command& c, const DevBuffers&) override {
      const DeviceBuffers& b = be_.host_;
      std::vector<std::uint32_t>& plan = be_.host_plan_;
      plan.resize(std::size_t(c.rows) * be_.layout_.top_k);
      for (std::size_t i = 0; i < plan.size(); ++i)
        plan[i] = smap_load(b.smap, be_.key(c.layer, b.ids[i]));
    }
    // The plan is known: a pass with no entry (decode with every expert resident, or none)
    // launches nothing. The pass's groups (this one's, or gate_up's before this down) are
    // known here; the decode kernels take them as arguments.
    Grouped group_pass(const Command& c, bool regroup, DevBuffers& dev) override {
      if (be_.pass_is_empty(c.rows, c.pass)) return Grouped{false, ""};
      Grouped g;
      if (regroup) {
        be_.mirror_pass(c.layer, c.rows, c.pass);
        g.error = be_.group_on_host(c.layer, c.rows, select_of(c.pass));
      }
      dev.host_groups = be_.host_groups_.data();
      return g;
    }
    // The host wrote the wave before releasing it; this thread runs after that release.
    std::string group_wave(const Command& c, DevBuffers& dev) override {
      const DeviceBuffers& b = be_.host_;
      for (std::uint32_t w = 0; w < *b.wave_n; ++w) be_.mirror(be_.key(c.layer, b.wave[w]));
      std::string err = be_.group_on_host(c.layer, c.rows, Select::Wave);
      dev.host_groups = be_.host_groups_.data();
      return err;
    }
    // A queued Signal makes the caller's stream wait for the kernels (an event after them) and
    // returns; the host learns they ended at the next synchronize(). Every unpublished expert
    // is found by group_on_host() before then, so a layer's handshake bug is still its own
    // call's error.
    bool completes_async() const override { return true; }
    // The mirror, filled at IO completion (the Window registers it after bind()).
    RecordObserver* observer() override { return &be_.mirror_; }

   private:
    CudaBackend& be_;
  };

  // Mapped: the kernels read the host arena through the mapping; the plan and the grouping are
  // kernels.
  class MappedArena final : public ArenaStrategy {
   public:
    explicit MappedArena(CudaBackend& be) : be_(be) {}
    const unsigned char* bind_arena(const DeviceBuffers&, const PackLayout&,
                                    const unsigned char* mapped) override {
      return mapped;
    }
    void plan(const Command& c, const DevBuffers& dev) override {
      cuda_check(launch_plan(be_.layout_, dev, c.layer, c.rows, be_.stream_), "plan");
    }
    // With entries or none, the group kernel checks each slot.
    Grouped group_pass(const Command& c, bool regroup, DevBuffers& dev) override {
      if (regroup)
        cuda_check(launch_group(be_.layout_, dev, c.layer, c.rows, select_of(c.pass),
                                be_.stream_),
                   "group");
      return Grouped{};
    }
    std::string group_wave(const Command& c, DevBuffers& dev) override {
      const DeviceBuffers& b = be_.host_;
      be_.upload(const_cast<std::uint32_t*>(be_.dev_.wave_n), b.wave_n, 4);
      be_.upload(const_cast<std::int32_t*>(be_.dev_.wave), b.wave, std::size_t(*b.wave_n) * 4);
      cuda_check(launch_group(be_.layout_, dev, c.layer, c.rows, Select::Wave, be_.stream_),
                 "group");
      return "";
    }
    // The group kernel reports through the error word, which only a drain reads: it keeps
    // draining at every Signal.
    bool completes_async() const override { return false; }
    RecordObserver* observer() override { return nullptr; }

   private:
    CudaBackend& be_;
  };

  static Select select_of(Pass p) {
    return p == Pass::Resident ? Select::Resident : Select::Missing;
  }

  std::unique_ptr<ArenaStrategy> make_arena_strategy() {
    if (mode_ == ArenaMode::Device) return std::make_unique<DeviceArena>(*this);
    return std::make_unique<MappedArena>(*this);
  }

  // STRATA_CUDA_TRACE=1: the device thread's time per command kind, printed when the backend
  // goes (where a layer's microseconds go: launches, copies, waits for the host, syncs).
  void print_trace() const {
    static const char* names[] = {"Route", "RoutePredict", "Plan", "GateUp", "Down",
                                  "MoeMM", "Combine",      "Signal", "Wait"};
    std::fprintf(stderr, "strata cuda trace (device thread, us per command):");
    for (std::size_t i = 0; i < 9; ++i)
      if (op_calls_[i])
        std::fprintf(stderr, " %s %.1f x%llu", names[i], 1e-3 * double(op_ns_[i]) / double(op_calls_[i]),
                     static_cast<unsigned long long>(op_calls_[i]));
    const std::uint64_t at_io = mirror_.copies_at_completion();
    std::fprintf(stderr,
                 " | slot copies at IO completion %llu (IO thread us a record: %.1f queueing, %.1f"
                 " waiting; %llu chunks copied as their parts landed), lazy %llu",
                 static_cast<unsigned long long>(at_io),
                 at_io ? 1e-3 * double(mirror_.issue_ns()) / double(at_io) : 0.0,
                 at_io ? 1e-3 * double(mirror_.wait_ns()) / double(at_io) : 0.0,
                 static_cast<unsigned long long>(mirror_.chunk_copies()),
                 static_cast<unsigned long long>(mirror_.copies_lazy()));
    std::fprintf(stderr, " | queued completions %llu",
                 static_cast<unsigned long long>(queued_signals_));
    const auto [p50, p90, n] = crossing_us();
    std::fprintf(stderr,
                 " | GPU idle across a handshake (Signal to release): p50 %.1f us, p90 %.1f us,"
                 " n %zu\n",
                 p50, p90, n);
  }

  // STRATA_CUDA_TRACE=1: the handshake on the GPU's own clock. An event recorded on the stream
  // at a Signal (after the kernels before it) and one recorded right after the host's release
  // of the Wait that follows (no kernel between): their distance is how long the GPU stood
  // between the work before the crossing and the earliest moment work after it could start
  // (GPU -> host -> GPU), the next launch's own latency not included. Read when the backend goes.
  void open_crossing() {
    crossing_open_ = false;
    if (crossings_.size() >= kMaxCrossings) return;
    cudaEvent_t start = nullptr;
    if (cudaEventCreate(&start) != cudaSuccess) return;
    if (cudaEventRecord(start, stream_) != cudaSuccess) return void(cudaEventDestroy(start));
    crossings_.emplace_back(start, nullptr);
    crossing_open_ = true;
  }
  void close_crossing() {
    if (!crossing_open_) return;
    crossing_open_ = false;
    cudaEvent_t end = nullptr;
    if (cudaEventCreate(&end) != cudaSuccess) return;
    if (cudaEventRecord(end, stream_) != cudaSuccess) return void(cudaEventDestroy(end));
    crossings_.back().second = end;
  }
  // The crossings' median and 90th percentile, us (the stream has drained: every event is done).
  std::tuple<double, double, std::size_t> crossing_us() const {
    std::vector<float> us;
    for (const auto& [start, end] : crossings_) {
      float ms = 0.0f;
      if (end && cudaEventElapsedTime(&ms, start, end) == cudaSuccess) us.push_back(1e3f * ms);
    }
    if (us.empty()) return {0.0, 0.0, 0};
    std::sort(us.begin(), us.end());
    return {us[us.size() / 2], us[us.size() * 9 / 10], us.size()};
  }

  // A prediction's routing task: its ids go to the readback alone (only the host reads them).
  RouteTask predict_task(const Command& c) {
    const std::uint32_t d = c.distance - 1;
    dirty_.pred_rows[d] = std::max(dirty_.pred_rows[d], c.rows);
    return RouteTask{c.layer, nullptr, nullptr, back_.device<std::int32_t>(back_pred_[d]),
                     nullptr};
  }

  std::uint32_t key(std::uint32_t layer, std::int32_t expert) const {
    return layer * n_experts_ + std::uint32_t(expert);
  }

  // Device mode: makes slot smap[key]'s mirror hold `key`: already so when the copy at IO
  // completion did it (arena_mirror.h); else (the fallback) a copy queued before the kernels
  // that read it, on their stream. A published slot is complete and stays so while its layer
  // runs (I1, I4, I8), and the layer's last Signal drains the stream before the host may
  // recycle it. An absent key is left to the grouping, which reports it.
  void mirror(std::uint32_t k) {
    const std::uint32_t slot = smap_load(host_.smap, k);
    if (slot == kAbsentSlot || slot >= host_.n_slots) return;
    mirror_.ensure(slot, k, host_.arena, stream_);
  }

  bool pass_is_empty(std::uint32_t rows, Pass pass) const {
    if (host_plan_.size() != std::size_t(rows) * layout_.top_k) return false;  // no plan: unknown
    for (std::uint32_t slot : host_plan_)
      if ((slot != kAbsentSlot) == (pass == Pass::Resident)) return false;
    return true;
  }

  // The slots a decode pass will read: the plan's for Resident, smap's now for Missing.
  void mirror_pass(std::uint32_t layer, std::uint32_t rows, Pass pass) {
    const std::size_t n = std::size_t(rows) * layout_.top_k;
    for (std::size_t i = 0; i < n && i < host_plan_.size(); ++i) {
      const bool resident = host_plan_[i] != kAbsentSlot;
      if (resident != (pass == Pass::Resident)) continue;
      const std::uint32_t k = key(layer, host_.ids[i]);
      if (pass == Pass::Resident) {
        // The plan's slot (it is smap[k] still: the layer's slots stay put, I8).
        const std::uint32_t slot = host_plan_[i];
        if (slot < host_.n_slots) mirror_.ensure(slot, k, host_.arena, stream_);
      } else {
        mirror(k);
      }
    }
  }

  // Device mode: the group kernel's work (experts.cu), done here, where the plan and smap
  // already are (this thread read both to mirror the pass's slots), and uploaded in one copy
  // laid out as groups_ is (bind()): no launch, and no plan upload either (the device reads the
  // plan only through the groups). Entries go in index order inside a group; the group kernel's
  // order is arbitrary, and each entry's outputs are computed alone, so the bits are the same.
  // An expert with no published slot is reported and the pass computes nothing (groups_n 0).
  std::string group_on_host(std::uint32_t layer, std::uint32_t rows, Select sel) {
    const DeviceBuffers& b = host_;
    const std::uint32_t E = n_experts_;
    const std::size_t n = std::size_t(rows) * layout_.top_k;
    std::vector<std::uint32_t>& g = host_groups_;
    g.assign(1 + 8 * std::size_t(E) + n, 0);
    std::uint32_t* slot_of = g.data() + 1;
    std::uint32_t* start_of = slot_of + E;
    std::uint32_t* count_of = start_of + E;
    std::uint32_t* count = count_of + E;  // the kernel's scratch sections, used as such here
    std::uint32_t* cursor = count + E;
    std::uint32_t* first = cursor + E;
    std::uint32_t* in_wave = first + E;
    std::uint32_t* entries = g.data() + 1 + 8 * std::size_t(E);
    if (sel == Select::Wave)
      for (std::uint32_t w = 0; w < *b.wave_n; ++w)
        if (std::uint32_t(b.wave[w]) < E) in_wave[b.wave[w]] = 1;
    auto accepts = [&](std::size_t i, std::uint32_t e) {
      if (sel == Select::Resident) return host_plan_[i] != kAbsentSlot;
      if (sel == Select::Missing) return host_plan_[i] == kAbsentSlot;
      return in_wave[e] != 0;
    };
    if (sel != Select::Wave && host_plan_.size() != n) return "cuda: an expert pass without a plan";
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint32_t e = std::uint32_t(b.ids[i]);
      if (e >= E) return "cuda: routed expert " + std::to_string(e) + " out of range";
      if (!accepts(i, e)) continue;
      if (count[e]++ == 0) first[e] = std::uint32_t(i);
    }
    std::uint32_t groups = 0, offset = 0;
    for (std::uint32_t e = 0; e < E; ++e) {
      if (count[e] == 0) continue;
      // Resident: the slot the plan saw (I8 keeps it valid). Missing and waves: published by
      // now (the host released this pass only after it was).
      const std::uint32_t slot = sel == Select::Resident
                                     ? host_plan_[first[e]]
                                     : smap_load(b.smap, key(layer, std::int32_t(e)));
      if (slot == kAbsentSlot || slot >= b.n_slots) {
        g[0] = 0;  // nothing is computed
        upload(groups_.as<void>(), g.data(), 4);
        const char* what = sel == Select::Resident  ? "resident"
                           : sel == Select::Missing ? "missing"
                                                    : "wave";
        return "device: expert " + std::to_string(e) + " of layer " + std::to_string(layer) +
               " has no published slot when its " + what + " pass runs (handshake bug)";
      }
      slot_of[groups] = slot;
      start_of[groups] = offset;
      count_of[groups] = count[e];
      cursor[e] = offset;
      offset += count[e];
      ++groups;
    }
    g[0] = groups;
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint32_t e = std::uint32_t(b.ids[i]);
      if (accepts(i, e)) entries[cursor[e]++] = std::uint32_t(i);
    }
    // The decode kernels take the groups as arguments (execute() points them at host_groups_):
    // no copy on the stream before them.
    if (!groups_as_arguments(layout_, rows)) upload(groups_.as<void>(), g.data(), g.size() * 4);
    return "";
  }

  // A queued Signal (Command::queued): the caller's stream waits on the device for everything
  // queued here so far (the event after the layer's last kernel), and the host is told at once.
  // Nothing is brought back (a routed call on device memory writes out in place: dirty_ is
  // empty), the staging is not reused before the next drain, and the error word waits for it
  // too (synchronize(), the Window's retire, before it reuses anything these kernels read). A
  // failure to order the caller's stream is this call's error, after a drain (so nothing runs
  // unordered behind the caller's back), and the event is signalled either way: the host never
  // waits out its timeout for it.
  std::string signal_queued(const Item& it) {
    cudaError_t e = cudaEventRecord(queued_done_, stream_);
    if (e == cudaSuccess)
      e = cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(it.io.stream), queued_done_, 0);
    std::string err;
    if (e != cudaSuccess) {
      cudaGetLastError();
      err = cuda_message("ordering the caller's stream after the layer's kernels", e);
      cudaStreamSynchronize(stream_);
    }
    ++queued_signals_;
    it.c.event->signal(it.c.value);
    return err;
  }

  // Why `s` is not a stream this backend can order ("" when it is): a handle the runtime does
  // not know (the legacy default stream, 0, is one it knows).
  static std::string stream_problem(std::uintptr_t s) {
    const cudaError_t e = cudaStreamQuery(reinterpret_cast<cudaStream_t>(s));
    if (e == cudaSuccess || e == cudaErrorNotReady) return "";
    cudaGetLastError();
    return std::string("stream is not a CUDA stream of this process (") + cudaGetErrorName(e) +
           ")";
  }

  // Waits for the stream, brings the host what it reads (the kernels wrote it into the
  // readback, which the drain makes visible here) and reads the error word.
  std::string settle() {
    const DeviceBuffers& b = host_;
    const std::size_t H = layout_.hidden, k = layout_.top_k;
    cuda_check(cudaStreamSynchronize(stream_), "stream");
    const unsigned char* back = back_.as<const unsigned char>();
    if (dirty_.ids_rows) {
      std::memcpy(b.ids, back + back_ids_, dirty_.ids_rows * k * 4);
      std::memcpy(b.weights, back + back_weights_, dirty_.ids_rows * k * 4);
    }
    for (int d = 0; d < 2; ++d)
      if (dirty_.pred_rows[d])
        std::memcpy(b.pred_ids[d], back + back_pred_[d], dirty_.pred_rows[d] * k * 4);
    if (dirty_.out_rows) std::memcpy(b.out, back + back_out_, dirty_.out_rows * H * 4);
    dirty_ = {};
    up_used_ = 0;
    return read_error_word();
  }

  // The error word a kernel set, as a message (and cleared); "" when none. After a sync only.
  std::string read_error_word() {
    volatile DevError* e = err_host_;
    if (!e->flag) return "";
    const std::string what = e->what == 1 ? "resident" : e->what == 2 ? "missing" : "wave";
    std::string m = "device: expert " + std::to_string(e->expert) + " of layer " +
                    std::to_string(e->layer) + " has no published slot when its " + what +
                    " pass runs (handshake bug)";
    e->flag = 0;
    return m;
  }

  cudaStream_t stream_ = nullptr;
  // Recorded after a layer's last kernel at a queued Signal, for the caller's stream to wait on
  // (a wait takes the record's state when it is queued, so one event serves every layer).
  cudaEvent_t queued_done_ = nullptr;
  std::uint64_t queued_signals_ = 0;  // the device thread's (printed by the trace)
  DevError* err_host_ = nullptr;  // mapped pinned; written by kernels, read after a sync
  // Bound state: written by bind() while the device thread is idle, read by it afterwards
  // (the queue's lock orders the two).
  DevLayout layout_;
  DevBuffers dev_;
  DeviceBuffers host_;
  const unsigned char* host_arena_ = nullptr;
  const std::uint32_t* host_smap_ = nullptr;
  const float* host_routers_ = nullptr;
  DeviceArray routers_, x_, ids_, weights_, plan_, h_, y_, wave_, wave_n_, groups_;
  DeviceArray logits_, route_done_;  // the route kernel's scratch
  DeviceArray x_pieces_, h_pieces_;  // the tensor-core kernels' scratch (bf16 packs only)
  DeviceArray x_rest_;               // and whether each row of x is bf16 values (pieces.cuh)
  // The device thread's (bind() sizes them while it is idle): staging up, and the readback the
  // kernels write what the host reads into (byte offsets of its sections).
  PinnedArray up_, back_;
  std::size_t up_used_ = 0;
  std::size_t back_ids_ = 0, back_weights_ = 0, back_pred_[2] = {0, 0}, back_out_ = 0;
  const Tuning tuning_;
  const ArenaMode mode_;
  std::unique_ptr<ArenaStrategy> arena_;  // mode_'s, made by the constructor
  const std::chrono::microseconds spin_;  // kSpin: the device thread's spin
  // STRATA_CUDA_BF16 as asked (Tuning::bf16) and settled for this GPU (by the first
  // bind of a bf16 pack; bind() runs while the device thread is idle).
  Bf16Family bf16_asked_ = Bf16Family::Auto;
  std::optional<Bf16Family> bf16_family_;
  // Device mode: the arena's device copy and its per-slot tags, written by the IO threads (at
  // IO completion) and the device thread (the fallback): its own locks (arena_mirror.h).
  ArenaMirror mirror_;
  std::uint32_t n_experts_ = 0;
  // The device thread's own (bind() resets them while it is idle).
  std::vector<std::uint32_t> host_plan_;   // Device mode: the last Plan's snapshot
  std::vector<std::uint32_t> host_groups_;  // Device mode: group_on_host()'s upload
  const bool trace_;  // Tuning::trace
  std::uint64_t op_ns_[9] = {}, op_calls_[9] = {};  // the device thread's (trace_)
  static constexpr std::size_t kMaxCrossings = 1 << 14;
  std::vector<std::pair<cudaEvent_t, cudaEvent_t>> crossings_;  // the device thread's (trace_)
  bool crossing_open_ = false;                                  // the device thread's (trace_)
  // The device thread's own.
  Dirty dirty_;
  Op last_op_ = Op::Signal;
  Pass last_pass_ = Pass::Resident;
  std::uint32_t last_layer_ = 0, last_rows_ = 0;
};

}  // namespace

std::string tuning_description() { return Tuning::from_env().describe(); }

std::string unavailable() {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return std::string("no usable CUDA driver or GPU (") + cudaGetErrorName(e) + ": " +
           cudaGetErrorString(e) + ")";
  }
  if (n == 0) return "no CUDA GPU on this machine";
  return "";
}

std::unique_ptr<Backend> make_cuda_backend() {
  std::string why = unavailable();
  if (!why.empty()) throw std::runtime_error(why);
  return std::make_unique<CudaBackend>();
}

}  // namespace strata::cuda
