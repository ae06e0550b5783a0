// The Metal backend: the Backend interface on an MTLDevice with metal-cpp (no Objective-C++).
//  - bind(): the arena becomes no-copy buffers of whole slots (views when it exceeds
//    maxBufferLength), smap, routers and every scratch array are no-copy shared buffers over
//    the host's own pages, all of them in one residency set (macOS 15+);
//  - submit(): one command buffer per call - the Window makes one call per layer call (one per
//    step in split-turn mode) - with the kernels of dispatch_plan.h in compute encoders and the
//    handshake's waits and signals encoded between them (event_bridge.h);
//  - errors: a kernel that finds an absent expert sets the status buffer; a failed command
//    buffer is recorded by its completion handler; both surface through take_device_error().
#include "metal_backend.h"

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <vector>

#include <Foundation/Foundation.hpp>
#include <Metal/Metal.hpp>

#include "common/errors.h"
#include "dispatch_plan.h"
#include "event_bridge.h"
#include "kernel_library.h"
#include "metal_event.h"

namespace strata {
namespace {

using metal::Dispatch;
using metal::DispatchPlanner;

// Apple silicon's VM page, which no-copy buffers need: the pack's record alignment (kPage), to
// which the arena and the smap are aligned.
constexpr std::uint64_t kHostPage = kPage;

[[noreturn]] void fail(const std::string& what) {
  throw EngineError(ErrorKind::Config, "Metal backend: " + what);
}

// A buffer bound at an offset: no-copy wrappers start on a page boundary, the array may not.
// Autoreleased metal-cpp objects (command buffers, encoders, strings) die with the pool.
class Pool {
 public:
  Pool() : pool_(NS::AutoreleasePool::alloc()->init()) {}
  ~Pool() { pool_->release(); }
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

 private:
  NS::AutoreleasePool* pool_;
};

struct Binding {
  MTL::Buffer* buffer = nullptr;
  std::uint64_t offset = 0;
};

class MetalBackend final : public Backend {
 public:
  explicit MetalBackend(const MetalBackendOptions& options) {
    device_ = MTL::CreateSystemDefaultDevice();
    if (!device_) fail("no Metal device");
    try {
      open(options);
    } catch (...) {
      close();
      throw;
    }
  }

  ~MetalBackend() override {
    abort_pending();
    synchronize();
    close();
  }

  std::string name() const override { return "metal"; }

  std::optional<std::string> unsupported(const Capability& c) const override {
    if (c.layout && c.layout->mixed())
      return "the Metal backend computes packs whose experts share one format; this pack's "
             "differ by layer or matrix (the cpu backend computes it)";
    if (c.io != Io::Host)
      return "the Metal backend reads x from and writes out to its bound buffers only (device "
             "pointers need the cuda backend)";
    if (c.moce != MoceMode::Off)
      return "the Metal backend does not implement cache-aware routing (moce); use the cpu "
             "backend for it";
    if (c.arithmetic != Arithmetic::Float32)
      return "the Metal backend computes in float32 only (MLX's arithmetic is the cpu "
             "backend's)";
    // per_entry: y is the host's scratch, wrapped without a copy, so the host reads it.
    return std::nullopt;
  }

 private:
  void open(const MetalBackendOptions& options) {
    Pool pool;
    if (!device_->hasUnifiedMemory())
      fail(std::string("device ") + device_->name()->utf8String() +
           " has no unified memory; the arena must be shared with the GPU without copies");
    queue_ = device_->newCommandQueue();
    if (!queue_) fail("cannot create a command queue");
    library_ = metal::load_kernel_library(device_, options.library_path, &library_source_);
    status_ = device_->newBuffer(STRATA_STATUS_WORDS * 4, MTL::ResourceStorageModeShared);
    std::memset(status_->contents(), 0, STRATA_STATUS_WORDS * 4);
    bridge_.emplace([device = device_](std::uint64_t initial) {
      return std::make_unique<metal::MetalEvent>(device, initial);
    });
  }

  void close() {
    bridge_.reset();
    release_buffers();
    for (auto& [name, pso] : pipelines_) pso->release();
    if (residency_) residency_->release();
    if (status_) status_->release();
    if (library_) library_->release();
    if (queue_) queue_->release();
    if (device_) device_->release();
  }

 public:
  void bind(const DeviceBuffers& b) override {
    synchronize();
    Pool pool;
    const PackLayout& L = *b.layout;
    const auto split = metal::split_arena(b.slot_bytes, b.n_slots, device_->maxBufferLength());
    planner_.emplace(L, b.slot_bytes, b.n_slots, split.slots_per_view);
    for (const std::string& k : planner_->kernel_names()) pipeline(k);
    // Buffers are cached by address range: a Window rebinding the same scratch (a warm prompt
    // scratch kept across turns under PROMPT_BUF_REUSE) reuses the same MTLBuffers.
    std::map<std::pair<const void*, std::uint64_t>, MTL::Buffer*> keep;
    auto wrap = [&](const void* p, std::uint64_t bytes) -> Binding {
      if (!p || bytes == 0) return {status_, 0};  // an unused slot still needs a binding
      const auto addr = reinterpret_cast<std::uintptr_t>(p);
      const std::uintptr_t base = addr & ~std::uintptr_t(kHostPage - 1);
      const std::uint64_t len = (addr + bytes - base + kHostPage - 1) & ~(kHostPage - 1);
      const auto key = std::make_pair(reinterpret_cast<const void*>(base), len);
      auto it = keep.find(key);
      if (it == keep.end()) {
        auto old = wrapped_.find(key);
        MTL::Buffer* buf = nullptr;
        if (old != wrapped_.end()) {
          buf = old->second;
          wrapped_.erase(old);
        } else {
          buf = device_->newBuffer(reinterpret_cast<void*>(base), len,
                                   MTL::ResourceStorageModeShared, nullptr);
          if (!buf) fail("cannot wrap " + std::to_string(len) + " bytes of host memory");
        }
        it = keep.emplace(key, buf).first;
      }
      return {it->second, addr - base};
    };
    Binding bind[STRATA_BUF_COUNT];
    try {
      const std::uint64_t T = b.max_rows, k = L.top_k, E = L.n_experts, H = L.hidden,
                          I = L.moe_intermediate;
      bind[STRATA_BUF_SMAP] = wrap(b.smap, std::uint64_t(L.n_keys()) * 4);
      bind[STRATA_BUF_ROUTERS] = wrap(b.routers, std::uint64_t(L.n_layers) * E * H * 4);
      bind[STRATA_BUF_X] = wrap(b.x, T * H * 4);
      bind[STRATA_BUF_IDS] = wrap(b.ids, T * k * 4);
      bind[STRATA_BUF_WEIGHTS] = wrap(b.weights, T * k * 4);
      bind[STRATA_BUF_PRED1] = wrap(b.pred_ids[0], T * k * 4);
      bind[STRATA_BUF_PRED2] = wrap(b.pred_ids[1], T * k * 4);
      bind[STRATA_BUF_LOGITS] = wrap(b.logits, T * E * 4);
      bind[STRATA_BUF_PLAN] = wrap(b.plan, T * k * 4);
      bind[STRATA_BUF_H] = wrap(b.h, T * k * I * 4);
      bind[STRATA_BUF_Y] = wrap(b.y, T * k * H * 4);
      bind[STRATA_BUF_OUT] = wrap(b.out, T * H * 4);
      bind[STRATA_BUF_WAVE] = wrap(b.wave, E * 4);
      bind[STRATA_BUF_WAVE_N] = wrap(b.wave_n, 4);
      bind[STRATA_BUF_STATUS] = {status_, 0};
      for (std::uint32_t v = 0; v < STRATA_MAX_ARENA_VIEWS; ++v) {
        const std::uint32_t first = v < split.n_views ? v * split.slots_per_view : 0;
        const std::uint32_t n = std::min(split.slots_per_view, b.n_slots - first);
        bind[STRATA_BUF_ARENA0 + v] = wrap(b.arena + first * b.slot_bytes, n * b.slot_bytes);
      }
    } catch (...) {
      // Buffers taken for this binding go back; those not yet reused stay in wrapped_.
      for (auto& [key, buf] : keep) buf->release();
      planner_.reset();  // no submit against a half-made binding
      throw;
    }
    release_buffers();
    wrapped_ = std::move(keep);
    std::copy(std::begin(bind), std::end(bind), bindings_);
    make_resident();
    buffers_ = b;
  }

  void submit(const std::vector<Command>& commands) override {
    if (!planner_) fail("submit before bind");
    Pool pool;  // commandBuffer() and the encoders are autoreleased
    MTL::CommandBuffer* cb = queue_->commandBuffer();
    if (!cb) fail("cannot create a command buffer");
    cb->retain();
    MTL::ComputeCommandEncoder* enc = nullptr;
    std::vector<Dispatch> ds;
    std::vector<std::pair<SharedEvent*, std::uint64_t>> signals;
    auto end_encoder = [&] {
      if (enc) enc->endEncoding();
      enc = nullptr;
    };
    try {
      for (const Command& c : commands) {
        if (c.op == Op::Signal || c.op == Op::Wait) {
          end_encoder();  // event commands live between encoders
          MTL::SharedEvent* ev =
              static_cast<metal::MetalEvent*>(bridge_->device_event(c.event))->mtl();
          if (c.op == Op::Wait) {
            cb->encodeWait(ev, c.value);
            bridge_->device_waits_for(c.event, c.value);
          } else {
            cb->encodeSignalEvent(ev, c.value);
            signals.emplace_back(c.event, c.value);
          }
          continue;
        }
        ds.clear();
        planner_->plan(c, &ds);
        if (ds.empty()) continue;
        if (!enc) {
          enc = cb->computeCommandEncoder();  // serial: each dispatch sees the previous one
          for (int i = 1; i < STRATA_BUF_COUNT; ++i)
            enc->setBuffer(bindings_[i].buffer, bindings_[i].offset, i);
        }
        for (const Dispatch& d : ds) {
          enc->setComputePipelineState(pipeline(d.kernel));
          enc->setBytes(&d.params, sizeof(KernelParams), STRATA_BUF_PARAMS);
          enc->dispatchThreadgroups(MTL::Size(d.groups[0], d.groups[1], d.groups[2]),
                                    MTL::Size(d.threads[0], d.threads[1], d.threads[2]));
        }
      }
      end_encoder();
    } catch (...) {
      end_encoder();
      cb->release();  // never committed: none of its waits or signals exist for the device
      throw;
    }
    for (const auto& [ev, v] : signals) bridge_->device_will_signal(ev, v);
    cb->addCompletedHandler([this](MTL::CommandBuffer* done) { completed(done); });
    {
      std::lock_guard<std::mutex> lk(mu_);
      ++handlers_pending_;
      if (last_) last_->release();
      last_ = cb;
      cb->retain();
    }
    cb->commit();
    cb->release();
  }

  void synchronize() override {
    MTL::CommandBuffer* last = nullptr;
    {
      std::lock_guard<std::mutex> lk(mu_);
      last = last_;
      last_ = nullptr;
    }
    // Command buffers of one queue complete in order: the last one finishing means all did.
    if (last) {
      last->waitUntilCompleted();
      last->release();
    }
    {
      // waitUntilCompleted can return before the completion handler has run: wait for it too.
      std::unique_lock<std::mutex> lk(mu_);
      handlers_cv_.wait(lk, [&] { return handlers_pending_ == 0; });
    }
    if (bridge_) bridge_->drain_signals();
    status()[STRATA_STATUS_ABORT].store(0, std::memory_order_relaxed);
  }

  void abort_pending() override {
    // Kernels still queued return at once; waits still encoded are satisfied so the queue
    // drains; synchronize() clears the flag.
    status()[STRATA_STATUS_ABORT].store(1, std::memory_order_relaxed);
    if (bridge_) bridge_->release_device_waits();
  }

  std::string take_device_error() override {
    std::string e;
    {
      std::lock_guard<std::mutex> lk(mu_);
      e.swap(error_);
    }
    auto* st = status();
    const std::uint32_t code = st[STRATA_STATUS_ERROR].exchange(0, std::memory_order_relaxed);
    if (e.empty() && code == STRATA_ERROR_ABSENT)
      e = "device: an expert of layer " +
          std::to_string(st[STRATA_STATUS_LAYER].load(std::memory_order_relaxed)) +
          " has no published slot when its pass runs (handshake bug)";
    return e;
  }

 private:
  std::atomic<std::uint32_t>* status() {
    return static_cast<std::atomic<std::uint32_t>*>(status_->contents());
  }

  MTL::ComputePipelineState* pipeline(const std::string& name) {
    auto it = pipelines_.find(name);
    if (it != pipelines_.end()) return it->second;
    MTL::Function* fn =
        library_->newFunction(NS::String::string(name.c_str(), NS::UTF8StringEncoding));
    if (!fn) fail("kernel " + name + " missing from the " + library_source_);
    NS::Error* err = nullptr;
    MTL::ComputePipelineState* pso = device_->newComputePipelineState(fn, &err);
    fn->release();
    if (!pso)
      fail("kernel " + name + ": " +
           (err ? err->localizedDescription()->utf8String() : std::string("no pipeline")));
    pipelines_.emplace(name, pso);
    return pso;
  }

  // Arena and scratch stay resident across command buffers (macOS 15+: residency sets;
  // earlier systems make shared buffers resident per command buffer as before).
  void make_resident() {
    if (!NS::ProcessInfo::processInfo()->isOperatingSystemAtLeastVersion({15, 0, 0})) return;
    if (!residency_) {
      MTL::ResidencySetDescriptor* d = MTL::ResidencySetDescriptor::alloc()->init();
      d->setInitialCapacity(wrapped_.size() + 1);
      NS::Error* err = nullptr;
      residency_ = device_->newResidencySet(d, &err);
      d->release();
      if (!residency_) return;  // an optimisation only: run without it
      queue_->addResidencySet(residency_);
    }
    residency_->removeAllAllocations();
    for (const auto& [key, buf] : wrapped_) residency_->addAllocation(buf);
    residency_->addAllocation(status_);
    residency_->commit();
    residency_->requestResidency();
  }

  void release_buffers() {
    for (auto& [key, buf] : wrapped_) buf->release();
    wrapped_.clear();
  }

  void completed(MTL::CommandBuffer* cb) {
    std::lock_guard<std::mutex> lk(mu_);
    --handlers_pending_;
    handlers_cv_.notify_all();
    if (cb->status() != MTL::CommandBufferStatusError) return;
    NS::Error* err = cb->error();
    if (error_.empty())
      error_ = std::string("device: a Metal command buffer failed: ") +
               (err && err->localizedDescription() ? err->localizedDescription()->utf8String()
                                                   : "unknown error");
    // Its signals will never come: let the host see them, so no wait hangs on a dead buffer.
    bridge_->forward_pending_signals();
  }

  MTL::Device* device_ = nullptr;
  MTL::CommandQueue* queue_ = nullptr;
  MTL::Library* library_ = nullptr;
  std::string library_source_;
  MTL::Buffer* status_ = nullptr;  // shared; kernels write errors, the host the abort flag
  MTL::ResidencySet* residency_ = nullptr;
  std::map<std::string, MTL::ComputePipelineState*> pipelines_;
  std::optional<DispatchPlanner> planner_;
  DeviceBuffers buffers_;  // the layout pointer inside must outlive planner_ (it does: Window)
  std::map<std::pair<const void*, std::uint64_t>, MTL::Buffer*> wrapped_;
  Binding bindings_[STRATA_BUF_COUNT];
  std::optional<metal::EventBridge> bridge_;
  std::mutex mu_;
  MTL::CommandBuffer* last_ = nullptr;  // mu_: the newest committed command buffer
  std::string error_;                   // mu_: the first command-buffer failure
  int handlers_pending_ = 0;            // mu_: committed buffers whose handler has not run
  std::condition_variable handlers_cv_;
};

}  // namespace

std::unique_ptr<Backend> make_metal_backend(const MetalBackendOptions& options) {
  return std::make_unique<MetalBackend>(options);
}

}  // namespace strata
