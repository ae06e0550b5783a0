// Window: one MoE layer call = route -> handshake -> expert passes (docs/architecture.md section 2).
//
// The host side of the per-layer CPU/GPU handshake. Owns the backend, the routers and the
// scratch. Every chunk of a call is planned once (plan_chunk, exec/chunk_plan.h), encoded into
// backend commands and run by one of two executors (decode, waves), which drive ExpertStream at
// the host points of every layer:
//   at_layer(l):     one call per host point (decode, or each wave): protect and request the
//                    routed experts urgently, publish completed prefetches of l+1..l+2, queue
//                    the predictions behind them within one budget; then the device is released;
//   finish_layer(l): protect l+1, retire unchosen predictions of l to limbo, release limbo.
//
// Threads. Every method may be called from any thread at any time. A turn belongs to the thread
// that opened it: moe(), begin_turn() and end_turn() from another thread while it is open raise
// EngineError(Turn). One driving call runs at a time (door_mu_ admits it and marks busy_); it
// alone touches the scratch, the events and the backend, so those need no lock. The figures other
// threads read (stats, profile, routes, governor) are written under stats_mu_. close() waits for
// the call in flight, fails the open turn (the next call raises Closed), and frees the device
// thread, its worker pool, the scratch and the routers at once. Several Windows may share one
// ExpertStream: each registers its own client there and owns its protections (protection_set.h).
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "exec/backend.h"
#include "exec/chunk_plan.h"
#include "residency/expert_stream.h"
#include "policy/prefetch_governor.h"
#include "exec/scratch.h"
#include "exec/adaptive_spin.h"
#include "exec/shared_event.h"

namespace strata {

struct WindowOptions {
  bool lookahead = true;         // router l+1 on layer l's input, in prompt and decode
  // Two-layer lookahead: router l+2 on layer l's input too, for decode-sized chunks
  // (STRATA_METAL_PREFETCH2) and for larger ones (STRATA_METAL_PROMPT_PRED2), on every path.
  bool two_layer_decode = false;
  bool two_layer_prompt = false;
  std::uint32_t two_layer_max = 64;  // STRATA_METAL_PROMPT_PRED2_MAX: new l+2 reads per handshake
  // STRATA_METAL_PROMPT_BUF_REUSE: keep the prompt scratch (and the backend's views of it)
  // across turns instead of releasing it when a turn ends.
  bool prompt_buf_reuse = false;
  bool record_routes = false;    // keep (token, layer, expert) of every routed choice
  // STRATA_METAL_PROMPT_START_LAYERS: at turn start, queue profile-ranked experts of layers
  // 0..n-1 (layer 0 up to top_k of them, later layers up to 32 new reads each).
  std::uint32_t start_layers = 1;
  // With lookahead off, the handshake of layer l queues layer l+1's most popular experts by the
  // profile as Profile reads (docs/architecture.md section 6): top_k per row, at most kProfileRowsMax rows'
  // worth, and only those the call's rows more likely than not use. STRATA_PROFILE_PREFETCH.
  bool profile_prefetch = true;
  // STRATA_PREFETCH_BACKOFF: a PrefetchGovernor caps the speculative reads each handshake
  // starts when they do not pay; off, the cap is always unlimited.
  bool prefetch_backoff = true;
  GovernorOptions governor;
  bool split_turn = false;       // each step its own submission (host works between them)
  std::uint32_t max_rows = 1024; // prompt chunk rows (MT)
  std::uint32_t decode_rows = 4; // T <= this (and its experts fit) takes the decode path
  // An externally routed call of up to this many rows (B sequences decoding together) takes the
  // decode path while the union of its rows' experts fits one decode submission: the ids are
  // known before the submission, so the bound is the union, not rows * top_k.
  std::uint32_t decode_batch_rows = 64;
  double device_timeout_s = 600; // bound on any single wait for the device
  // Cache-aware routing (STRATA_MOCE*): adjusts the routed selection by residency (moce.h).
  MoceParams moce;
};

struct LayerStats {
  std::uint64_t calls = 0, tokens = 0, hits = 0, misses = 0, bytes_read = 0;
  std::uint64_t stall_ns = 0;      // host blocked on urgent reads
  std::uint64_t handshake_ns = 0;  // host time in at_layer + after_layer, IO waits excluded
  // The same, as CPU time of the host thread: what the work costs, without the time the
  // scheduler gives the IO and device threads (which dominates wall time on a 2-core machine).
  std::uint64_t handshake_cpu_ns = 0;
  std::uint64_t waves = 0;
  // Prediction at distance 1, as sums over calls: |predicted & actual|, |predicted|, |actual|.
  std::uint64_t pred_correct = 0, pred_predicted = 0, pred_actual = 0;
  // moce: true router probability mass the selection moved off the true top-k (summed over
  // tokens) and how many true top-k choices it replaced.
  double moce_moved = 0;
  std::uint64_t moce_changed = 0;
  std::uint64_t settle_ns = 0;  // host waiting for speculative reads (deterministic moce path)
};

// What a Window's own route needs of its backend (moce), for choosing one (make_backend).
Capability route_capability(const PackLayout& layout, const MoceParams& moce);

struct HostTimer;  // window.cpp: times a host-work section as wall and thread CPU time

class Window {
 public:
  // The profile fallback queues top_k experts per row of at most this many rows: one decode
  // token needs top_k experts of l+1, and for a prompt chunk the next layer's own urgent waves
  // read the rest anyway, so more would only sit in the IO queue in front of them.
  static constexpr std::uint32_t kProfileRowsMax = 2;

  // Registers with `stream` (throws Closed when it is closed).
  Window(ExpertStream& stream, std::unique_ptr<Backend> backend, const WindowOptions& options);
  ~Window();  // close(), then leaves the stream
  Window(const Window&) = delete;
  Window& operator=(const Window&) = delete;

  // x: [rows, hidden] float32, out: [rows, hidden] float32. A call at layer 0 outside a turn
  // opens one (owned by the calling thread) that ends after layer L-1. Throws EngineError(Turn)
  // for a layer out of order or a turn owned by another thread, Closed after close(); the turn
  // is abandoned (and the stream stays usable) on any error inside the call.
  void moe(std::uint32_t layer, const float* x, std::uint32_t rows, float* out,
           const InterruptCheck& interrupt = {});
  // ---- externally routed calls: the model routes with its own gate (any family) ----
  enum class XType : std::uint8_t { F32, F16, BF16 };
  // One call's routing, [rows, top_k] each, row-major. pred1/pred2: the model's gates of layers
  // l+1 / l+2 applied to this layer's input (null: no prediction at that distance), used as
  // wants_predictions says.
  struct Routed {
    const std::int32_t* ids = nullptr;
    const float* weights = nullptr;  // mixture weights; unused by moe_routed_external
    const std::int32_t* pred1 = nullptr;
    const std::int32_t* pred2 = nullptr;
    // How moe_routed's expert passes round (backend.h): an Mlx mode reproduces mlx-lm's own
    // CPU arithmetic; only the CPU backend has it, and only for the formats MLX computes that
    // way (the call throws EngineError(Config) naming why not).
    Rounding rounding;
    // moe_routed: out is [rows, top_k, hidden], each entry's weighted expert output in k order,
    // not their sum (an experts module's return, for a block that mixes them itself; weights of
    // 1 give the expert outputs themselves). Needs a backend whose y the host reads
    // (per_entry_unsupported()).
    bool per_entry = false;
  };
  // As moe(), with the routing given: the same handshake (urgent requests, predictions queued,
  // publish, retire) and expert passes on the backend. x: [rows, hidden] of type xt, converted
  // to float32 as it enters the scratch. Throws EngineError(Config) with moce on (moce steers
  // the engine's own router) and std::out_of_range for an expert id outside [0, n_experts).
  void moe_routed(std::uint32_t layer, const void* x, XType xt, std::uint32_t rows,
                  const Routed& routed, float* out, const InterruptCheck& interrupt = {});
  // As moe_routed, with x and out the caller's float32 memory on the backend's device
  // ([rows, hidden] each, row-major; a torch CUDA tensor, say): the backend reads x and writes
  // out there itself. The caller has finished writing x before the call (for torch: its stream
  // is synchronized, which the host-side ids already imply). Without `stream` the call returns
  // once out is complete on the device. With the caller's stream (a cudaStream_t as an integer;
  // 0 is the legacy default stream) on a backend that completes_async(), it returns once the
  // kernels are queued, `stream` waiting for them on the device: work queued there afterwards
  // reads out complete, and the caller must not write x or out on any other stream. The layer's
  // protections then stay in the stream until the completion is retired (completion_pending()).
  // Throws EngineError(Config) where the backend cannot (Capability::io; the cpu backend) or
  // for a pointer that is not memory of its device.
  void moe_routed_device(std::uint32_t layer, const float* x, std::uint32_t rows,
                         const Routed& routed, float* out, const InterruptCheck& interrupt = {},
                         std::optional<std::uintptr_t> stream = std::nullopt);
  // Whether the last call returned with its kernels still queued (moe_routed_device with a
  // stream): its layer's slots stay protected until the next call, begin_turn, end_turn or
  // close drains the backend (the completion is retired there, before anything is evicted).
  bool completion_pending() const;
  // Why this Window's backend cannot run moe_routed_device; "" when it can.
  const std::string& device_io_unsupported() const { return device_io_why_; }
  // Why this Window's backend cannot return per-entry outputs (Routed::per_entry); "" when it
  // can.
  const std::string& per_entry_unsupported() const { return per_entry_why_; }
  // The caller computes the experts (the MLX-kernel path; on a Mac MLX runs them on the GPU):
  // the same handshake, with nothing submitted to this Window's device, then for every
  // wave compute(row0, rows, slots) with slots[rows * top_k] the arena slot of each entry of
  // rows [row0, row0 + rows) whose expert is in the wave, kAbsent for the others. Those slots
  // hold their experts (published, protected by enter_layer and, with several waves, pinned by
  // a plan: I4, I8) until compute returns. Every entry appears in exactly one wave.
  using WaveCompute =
      std::function<void(std::uint32_t row0, std::uint32_t rows, const std::uint32_t* slots)>;
  void moe_routed_external(std::uint32_t layer, std::uint32_t rows, const Routed& routed,
                           const WaveCompute& compute, const InterruptCheck& interrupt = {});
  // Which predictions (router l+1, l+2 on layer l's input) an externally routed call of `rows`
  // rows at `layer` uses, so that its caller runs only those gates: the engine's one decision
  // (chunk_plan.h), the same for moe_routed and moe_routed_external, less the predictions of a
  // layer that can do nothing: with an arena that holds every expert of the pack, once every
  // expert of the predicted layer is published (nothing to read, nothing to evict it).
  Lookahead wants_predictions(std::uint32_t layer, std::uint32_t rows) const;

  // Opens an explicit turn (ending an implicit one of this thread). Turn error if one is open.
  void begin_turn();
  // Ends this thread's turn; nothing when no turn is open or the Window is closed.
  void end_turn();
  // Waits for the call in flight (another thread's), fails the open turn, releases the stream's
  // protections, the device thread and its pool, the scratch and the routers. Idempotent; safe
  // from several threads at once. Figures (stats, profile, routes) stay readable.
  void close();
  bool closed() const;
  bool in_turn() const;
  std::uint32_t next_layer() const;

  std::vector<LayerStats> layer_stats() const;
  // Routed choices recorded since the last call, as (token, layer, expert) triples, in the order
  // the engine met them (a prompt pass layer by layer). Tokens count from the first call.
  std::vector<std::int32_t> take_routes();
  // Expert popularity, learned online: tokens that chose each (layer, expert), [L * E].
  std::vector<std::uint32_t> profile() const;
  // Size must be L * E. Not while another thread's turn is open (Turn error).
  void set_profile(const std::vector<std::uint32_t>& counts);
  void reset_stats();
  const WindowOptions& options() const { return opt_; }
  const PackLayout& layout() const { return L_; }
  // The residency (1 = smap held a slot) the last moce route read, for the layer it routed;
  // empty until a moce route ran.
  std::vector<std::uint8_t> route_resident() const;
  std::int64_t route_layer() const;
  // Whether this Window settles IO before host points so that moce routing is deterministic.
  bool settles() const { return settles_; }
  PrefetchGovernor governor() const;  // a snapshot
  std::string backend_name() const { return backend_name_; }
  // Why this Window's backend cannot compute its pack's expert passes in `a` (at `layer`'s
  // format class; every layer's without one); "" when it can (Backend::unsupported, asked once
  // at construction).
  const std::string& arithmetic_unsupported(Arithmetic a) const {
    return arithmetic_why_[std::size_t(a)];
  }
  const std::string& arithmetic_unsupported(Arithmetic a, std::uint32_t layer) const {
    return class_arithmetic_why_[L_.class_of(layer)][std::size_t(a)];
  }
  std::uint64_t scratch_bytes() const { return scratch_bytes_.load(std::memory_order_relaxed); }
  ClientId client() const { return client_; }  // this Window's protections in the stream

 private:
  enum class Lifecycle : std::uint8_t { Open, Closing, Closed };
  // A call's kernels after it returned. A layer's protections (the executing layer's experts,
  // I4; layer l+1's, the next router's) end only at the next at_layer, enter_layer, end_turn or
  // release_client of this client, so a call that returns with its kernels queued (its chunk's
  // done Signal queued: chunk_plan.h) leaves them standing, and nothing of this Window may drop
  // them until the backend drained. Every chunk of such a call returns queued, so its chunks'
  // kernels run back to back on the device. Transitions, each named by its function:
  //   Done -> ChunkPending        defer_chunk(): a chunk returned with its kernels queued; the
  //                               call's next host point keeps its experts protected beside
  //                               its own, or drains first (keep_queued_chunk());
  //   ChunkPending -> LayerPending  defer_completion(): the call returned with its kernels
  //                               queued;
  //   LayerPending -> TurnEndPending  defer_turn_end(): that call was the implicit turn's last
  //                               layer; the Window's turn is over, the stream's end_turn waits;
  //   * -> Done                   drain(): backend_->synchronize() returned (every kernel done);
  //                               retire_completion() then ends a deferred turn in the stream,
  //                               teardown() and abandon_call() end its protections themselves.
  // Written by the busy_ holder under door_mu_ (completion_pending() reads it from any thread).
  enum class Completion : std::uint8_t { Done, ChunkPending, LayerPending, TurnEndPending };
  enum class TurnKind : std::uint8_t { None, Explicit, Implicit };
  // Admits one driving call: throws Closed after close(), Turn when another thread owns the turn
  // or is inside a call. Releases busy_ when destroyed.
  class Call;
  // Ends the open turn on the stream and frees a prompt-sized scratch (busy_ held).
  void finish_turn();
  // The stream's half of a turn's end (no device work in flight): its protections end, and a
  // prompt-sized scratch goes back when the turn ran prompt waves (`prompt`).
  void end_turn_in_stream(bool prompt);
  // backend_->synchronize(): every kernel submitted has finished, so nothing this Window
  // launched still reads a slot or the scratch; the completion is Done from here. Returns what
  // it was: a deferred turn end is the caller's to settle.
  Completion drain();
  // A pending completion ends: the backend drains, a deferred turn end reaches the stream, and
  // a device error the drained kernels met is thrown. Before anything that drops protections.
  void retire_completion();
  // Throws the device error the backend holds, if any (EngineError, Device).
  void raise_device_error();
  void defer_chunk();
  void defer_completion();
  void defer_turn_end();
  // Before anything of the call's next chunk `p` (its ids staged) is submitted: whether the
  // earlier chunks still queued (ChunkPending) keep their experts protected beside this one's
  // (at_layer's keep_executing). Only a one-wave chunk whose experts and the call's so far fit
  // a wave keeps them; otherwise the backend drains here (Done), so the waves find the room
  // they would find after any drained chunk.
  bool keep_queued_chunk(const ChunkPlan& p);
  // Abandons the layer call after an error: the device skips what is queued, the turn ends.
  void abandon_call();
  void teardown();  // close()'s release of everything (busy_ held)
  void ensure_scratch(std::uint32_t rows);
  // The one teardown path of the scratch: at turn end (unless kept) and at destruction.
  void release_scratch();
  // Checks turn order, runs chunk(r0, n, index) over the call's chunks of at most max_rows rows
  // (each leaves the experts it chose in buf_.chosen), then the after-layer host point. Any error
  // abandons the turn with the stream usable.
  using ChunkFn = std::function<void(std::uint32_t r0, std::uint32_t n, std::uint32_t chunk)>;
  // queued: the call's last chunk returns with its kernels queued (its plan's queued_done).
  void run_call(std::uint32_t layer, std::uint32_t rows, const ChunkFn& chunk,
                const InterruptCheck& interrupt, bool queued = false);
  void check_routed(std::uint32_t layer, const Routed& routed, std::uint32_t rows,
                    bool need_weights) const;
  // Copies rows [r0, r0 + n) of the routing into the scratch (ids, weights, predictions).
  void stage_routed(const Routed& routed, std::uint32_t r0, std::uint32_t n);
  // plan_chunk with this Window's rules, its wave capacity now and the governor's cap now (and
  // for a routed chunk the union of its rows' experts, counted in buf_.batch_marks).
  ChunkPlan plan(CallKind kind, std::uint32_t layer, std::uint32_t r0, std::uint32_t rows,
                 const Routed* routed, bool queued_done = false);
  // Runs one planned chunk: the first submission, the host point's bookkeeping, then the
  // plan's executor. Leaves the experts the chunk chose in buf_.chosen, most popular first.
  // compute: the caller's expert pass (CallKind::External).
  void run_chunk(const ChunkPlan& p, std::uint32_t chunk, const InterruptCheck& interrupt,
                 const WaveCompute* compute = nullptr);
  // keep: the host point keeps the call's queued chunks' protections (keep_queued_chunk).
  void run_decode(const ChunkPlan& p, std::uint32_t chunk, std::uint64_t v, bool keep,
                  Clock::time_point start, const InterruptCheck& interrupt);
  void run_waves(const ChunkPlan& p, std::uint32_t chunk, std::uint64_t v,
                 std::uint64_t first_wave, bool keep, Clock::time_point start,
                 const InterruptCheck& interrupt, const WaveCompute* compute);
  void submit(const std::vector<Command>& commands) { backend_->submit(commands); }
  // Learns the chunk's routing (profile, recorded routes, precision) and leaves its experts in
  // buf_.chosen, most popular first.
  void read_routing(const ChunkPlan& p, std::uint32_t chunk);
  // The distinct ids of ids[0, n) into `out`, most chosen first (ties to the lower id).
  void by_popularity(const std::int32_t* ids, std::uint32_t n, std::vector<std::int32_t>& out);
  // The speculative lists of the chunk's last host point, per the plan, into `r` (their lists
  // live in buf_): router l+1's and l+2's picks, or with lookahead off the profile's.
  void add_speculation(const ChunkPlan& p, std::uint32_t chunk, HandshakeRequest& r);
  void record_actual(std::uint32_t layer, std::uint32_t chunk,
                     const std::vector<std::int32_t>& chosen);
  void wait_device(SharedEvent& ev, std::uint64_t v, const InterruptCheck& interrupt,
                   AdaptiveSpin& spin);
  // Every expert of `layer` published, in an arena that holds every expert of the pack (so it
  // stays so): a prediction of that layer would request and protect nothing.
  bool all_resident_for_good(std::uint32_t layer) const;
  void stall_for(std::uint32_t layer, const std::int32_t* experts, std::size_t n,
                 const InterruptCheck& interrupt);
  void after(std::uint32_t layer, const std::vector<std::int32_t>& chosen,
             const InterruptCheck& interrupt);
  void settle(std::uint32_t layer, const InterruptCheck& interrupt);
  void note_moce(std::uint32_t layer, std::uint32_t rows);
  void count_urgent(std::uint32_t layer, const RequestResult& r);  // hits, misses, bytes
  void add_host_time(std::uint32_t layer, const HostTimer& t);

  // ---- speculation policy ----
  // Layer `layer`'s experts the profile has seen, most popular first (ties to the lower id),
  // at most n of them, into `out`.
  void profile_ranked(std::uint32_t layer, std::size_t n, std::vector<std::int32_t>& out) const;
  // New speculative reads this handshake may start: the governor's cap, or unlimited.
  std::uint32_t spec_cap() const;
  // Lookahead off: layer+1's profile favourites that a chunk of `rows` rows more likely than not
  // uses, into `out` (empty when the fallback is off or beyond the last layer: I10).
  void profile_candidates(std::uint32_t layer, std::uint32_t rows,
                          std::vector<std::int32_t>& out) const;
  // Was speculation reading while the host waited for urgent reads? Brackets the wait.
  struct SpecWatch {
    std::uint64_t in_flight_before = 0, started_before = 0;
  };
  SpecWatch watch_spec() const;
  bool spec_overlapped(const SpecWatch& w) const;
  // One handshake's evidence for the governor.
  void observe_handshake(bool decode, bool missed, bool contended, std::uint64_t wall_ns);
  std::uint32_t wave_capacity() const;
  PlanRules rules() const;

  ExpertStream& stream_;
  std::unique_ptr<Backend> backend_;  // null once closed
  const std::string backend_name_;
  // How long wait_device may spin before it blocks: the backend's host_spin(), read once; and
  // whether it does, learned per wait site (exec/adaptive_spin.h).
  const std::chrono::microseconds host_spin_;
  AdaptiveSpin spin_routed_, spin_wave_, spin_done_;
  std::array<std::string, 3> arithmetic_why_;  // written by the constructor only, then read-only
  // The same per format class of the pack (one for a uniform pack); the constructor's.
  std::vector<std::array<std::string, 3>> class_arithmetic_why_;
  std::string device_io_why_;  // Capability::io Device: the constructor's, then read-only
  std::string per_entry_why_;  // Capability::per_entry: the constructor's, then read-only
  bool completes_async_ = false;  // Backend::completes_async(), read once by the constructor
  WindowOptions opt_;
  const PackLayout& L_;
  std::vector<float> routers_;  // [n_layers][n_experts][hidden], read once from the pack

  Scratch scratch_;  // grown to the largest chunk seen and kept (bounded by max_rows: I12)
  // Whether the backend holds scratch_'s current buffers (ensure_scratch, inside a call or the
  // constructor; false from a reallocation until its bind returned). A bind that threw leaves
  // it false, so the next call binds again instead of handing the backend freed buffers.
  bool bound_ = false;
  // Host views of the scratch the device shares (set by ensure_scratch).
  float* x_ = nullptr;
  float* out_ = nullptr;
  std::int32_t* ids_ = nullptr;
  std::int32_t* pred1_ = nullptr;
  std::int32_t* pred2_ = nullptr;
  std::int32_t* wave_ = nullptr;
  std::uint32_t* wave_n_ = nullptr;
  float* weights_ = nullptr;

  const PlanRules rules_;  // immutable after construction: what plan_chunk decides by
  // The driving call's working lists, reused from chunk to chunk so that a warm layer call
  // allocates nothing (busy_ holder only; each sized once by the constructor or by the largest
  // chunk seen).
  struct ChunkBuffers {
    std::vector<Command> commands;          // the submission being encoded
    std::vector<std::uint32_t> votes;       // [n_experts] by_popularity's counts, kept zero
    std::vector<std::int32_t> chosen;       // this chunk's distinct experts, most popular first
    std::vector<std::int32_t> call_chosen;  // the call's distinct experts, in chunk order
    std::vector<char> seen;                 // [n_experts] run_call's marks, zero between calls
    std::vector<char> actual;               // [n_experts] record_actual's marks, kept zero
    std::vector<std::int32_t> pred1, pred2, profile;  // the chunk's speculative lists
    std::vector<std::uint32_t> wave_slots;  // the wave's experts' slots (plan_slots)
    std::vector<std::uint32_t> slot_of;     // [n_experts] expert -> slot this wave, else kAbsent
    std::vector<std::uint32_t> entry_slots; // [rows * top_k] the slots compute() is given
    std::vector<char> batch_marks;          // [n_experts] plan()'s union count, kept zero
  } buf_;
  // The open turn ran a chunk off the decode path (prompt waves): its scratch is prompt-sized
  // and goes back at the turn's end (unless BUF_REUSE); a turn of decode-path calls, a batch of
  // sequences included, keeps its few rows. busy_ holder only.
  bool turn_prompt_ = false;

  // Handshake events. Values only grow: every chunk takes seq_ + 1, every prompt wave
  // wave_seq_ + 1, so a stale signal can never release a later wait.
  SharedEvent routed_, release1_, release2_, done_, wave_release_, wave_done_;
  const HandshakeEvents events_{&routed_, &release1_, &release2_, &done_, &wave_release_,
                                &wave_done_};
  std::uint64_t seq_ = 0, wave_seq_ = 0;

  // door_mu_: who may drive the Window. The busy_ holder alone touches everything below that
  // is not marked otherwise (scratch, events, backend, seq_, predicted_, ...).
  mutable std::mutex door_mu_;
  std::condition_variable door_cv_;        // busy_ cleared, or closed
  Lifecycle life_ = Lifecycle::Open;       // door_mu_
  TurnKind turn_ = TurnKind::None;         // door_mu_
  std::thread::id owner_;                  // door_mu_: the thread whose turn is open
  bool busy_ = false;                      // door_mu_: a driving call (or close) is running
  std::thread::id busy_thread_;            // door_mu_: which thread runs it
  std::uint32_t next_layer_ = 0;           // door_mu_
  Completion completion_ = Completion::Done;  // door_mu_ for writes (the busy_ holder's)
  // A completion whose turn ended (TurnEndPending) ran prompt waves: the prompt scratch goes
  // back when it is retired. The busy_ holder's.
  bool pending_turn_prompt_ = false;
  ClientId client_ = kStreamClient;        // immutable after construction
  // The backend's record observer registered with the stream (Backend::record_observer), from
  // construction until teardown(), which removes it (waiting out an IO thread inside it) before
  // the backend goes. Set in the constructor, cleared by teardown (under the Closing state).
  std::optional<ObserverId> observer_;
  std::atomic<std::uint64_t> scratch_bytes_{0};

  // stats_mu_: figures written by the driving call and read by any thread.
  mutable std::mutex stats_mu_;
  std::vector<LayerStats> stats_;       // stats_mu_
  std::vector<std::int32_t> routes_;    // stats_mu_: (token, layer, expert) while record_routes
  std::vector<std::uint32_t> profile_;  // stats_mu_ for writes and other threads' reads
  PrefetchGovernor governor_;           // stats_mu_ for writes and other threads' reads
  template <class F>
  void with_stats(std::uint32_t layer, F&& f) {
    std::lock_guard<std::mutex> lk(stats_mu_);
    f(stats_[layer]);
  }
  // The stream's spec_requests / spec_hits at the last governor sample (deltas feed it).
  std::uint64_t gov_issued_ = 0, gov_used_ = 0;
  void queue_start_layers();
  std::int64_t tokens_seen_ = 0;      // tokens whose layer-0 call has started
  std::int64_t pass_first_token_ = 0; // first token of the pass now running
  // predicted_[layer][chunk]: experts router `layer` chose on layer-1's input, for
  // precision/recall when that chunk reaches `layer`.
  std::vector<std::vector<std::vector<std::int32_t>>> predicted_;
  // See settle() in window.cpp.
  bool settles_ = false;
  std::vector<std::uint8_t> route_resident_;  // stats_mu_
  std::int64_t route_layer_ = -1;              // stats_mu_
};

}  // namespace strata
