// Window: one MoE layer call = route -> handshake -> expert passes (docs/architecture.md section 2).
//
// The host side of the per-layer CPU/GPU handshake. Owns the backend, the routers and the
// scratch; drives ExpertStream at the two host points of every layer:
//   at_layer(l):    read the routed ids, request missing experts urgently, publish completed
//                   prefetches of l+1..l+2, queue predictions behind urgent work, release device;
//   after_layer(l): protect l+1, retire unchosen predictions of l to limbo, release limbo.
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
#include <string>
#include <thread>
#include <vector>

#include "exec/backend.h"
#include "residency/expert_stream.h"
#include "policy/prefetch_governor.h"
#include "exec/scratch.h"
#include "exec/shared_event.h"

namespace strata {

struct WindowOptions {
  bool lookahead = true;         // router l+1 on layer l's input, in prompt and decode
  bool prompt_pred2 = false;     // STRATA_METAL_PROMPT_PRED2: also router l+2, prompt path
  std::uint32_t pred2_max = 64;  // STRATA_METAL_PROMPT_PRED2_MAX: new l+2 reads per handshake
  bool decode_prefetch2 = false; // STRATA_METAL_PREFETCH2: also router l+2, decode path
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
  // l+1 / l+2 applied to this layer's input (null: no prediction at that distance). pred1 is
  // used when lookahead is on, pred2 when two-layer prediction is on for the path taken.
  struct Routed {
    const std::int32_t* ids = nullptr;
    const float* weights = nullptr;  // mixture weights; unused by moe_routed_host
    const std::int32_t* pred1 = nullptr;
    const std::int32_t* pred2 = nullptr;
    // How moe_routed's expert passes round (backend.h): an Mlx mode reproduces mlx-lm's own
    // CPU arithmetic; only the CPU backend has it, and only for the formats MLX computes that
    // way (the call throws EngineError(Config) naming why not).
    Rounding rounding;
  };
  // As moe(), with the routing given: the same handshake (urgent requests, predictions queued,
  // publish, retire) and expert passes on the backend. x: [rows, hidden] of type xt, converted
  // to float32 as it enters the scratch. Throws EngineError(Config) with moce on (moce steers
  // the engine's own router) and std::out_of_range for an expert id outside [0, n_experts).
  void moe_routed(std::uint32_t layer, const void* x, XType xt, std::uint32_t rows,
                  const Routed& routed, float* out, const InterruptCheck& interrupt = {});
  // The host computes the experts (the MLX-kernel path): the same handshake, then for every
  // wave compute(row0, rows, slots) with slots[rows * top_k] the arena slot of each entry of
  // rows [row0, row0 + rows) whose expert is in the wave, kAbsent for the others. Those slots
  // hold their experts (published, protected by enter_layer and, with several waves, pinned by
  // a plan: I4, I8) until compute returns. Every entry appears in exactly one wave.
  using WaveCompute =
      std::function<void(std::uint32_t row0, std::uint32_t rows, const std::uint32_t* slots)>;
  void moe_routed_host(std::uint32_t layer, std::uint32_t rows, const Routed& routed,
                       const WaveCompute& compute, const InterruptCheck& interrupt = {});

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
  // Why this Window's backend cannot compute its pack's expert passes in `a`; "" when it can
  // (Backend::arithmetic_unsupported, asked once at construction).
  const std::string& arithmetic_unsupported(Arithmetic a) const {
    return arithmetic_why_[std::size_t(a)];
  }
  std::uint64_t scratch_bytes() const { return scratch_bytes_.load(std::memory_order_relaxed); }
  ClientId client() const { return client_; }  // this Window's protections in the stream

 private:
  enum class Lifecycle : std::uint8_t { Open, Closing, Closed };
  enum class TurnKind : std::uint8_t { None, Explicit, Implicit };
  // Admits one driving call: throws Closed after close(), Turn when another thread owns the turn
  // or is inside a call. Releases busy_ when destroyed.
  class Call;
  // Ends the open turn on the stream and frees a prompt-sized scratch (busy_ held).
  void finish_turn();
  // Abandons the layer call after an error: the device skips what is queued, the turn ends.
  void abandon_call();
  void teardown();  // close()'s release of everything (busy_ held)
  void ensure_scratch(std::uint32_t rows);
  // The one teardown path of the scratch: at turn end (unless kept) and at destruction.
  void release_scratch();
  // Checks turn order, runs chunk(r0, n, index) over the call's chunks of at most max_rows rows
  // (each returns the experts it chose), then the after-layer host point. Any error abandons
  // the turn with the stream usable.
  using ChunkFn = std::function<std::vector<std::int32_t>(std::uint32_t r0, std::uint32_t n,
                                                          std::uint32_t chunk)>;
  void run_call(std::uint32_t layer, std::uint32_t rows, const ChunkFn& chunk,
                const InterruptCheck& interrupt);
  void check_routed(const Routed& routed, std::uint32_t rows, bool need_weights) const;
  // Copies rows [r0, r0 + n) of the routing into the scratch (ids, weights, predictions).
  void stage_routed(const Routed& routed, std::uint32_t r0, std::uint32_t n);
  // backend_->submit with the chunk's rounding on its expert passes.
  void submit(std::vector<Command> commands);
  // Returns the experts the chunk chose, most popular first. routed: the routing is already in
  // the scratch (no Route commands); host: the host computes each wave (no expert commands).
  std::vector<std::int32_t> run_chunk(std::uint32_t layer, std::uint32_t chunk, std::uint32_t rows,
                                      const InterruptCheck& interrupt,
                                      const Routed* routed = nullptr,
                                      const WaveCompute* host = nullptr);
  std::vector<std::int32_t> by_popularity(const std::int32_t* ids, std::uint32_t n) const;
  // Router l+1's picks for this chunk, most popular first (empty when not predicting), noted
  // for precision/recall.
  std::vector<std::int32_t> predictions(std::uint32_t layer, std::uint32_t chunk,
                                        std::uint32_t rows);
  bool predicts2(std::uint32_t layer, bool decode) const;
  // Router l+2's picks, most popular first (empty unless two-layer prediction is on here).
  std::vector<std::int32_t> predictions2(std::uint32_t layer, std::uint32_t rows, bool decode);
  void record_actual(std::uint32_t layer, std::uint32_t chunk,
                     const std::vector<std::int32_t>& chosen);
  void wait_device(SharedEvent& ev, std::uint64_t v, const InterruptCheck& interrupt);
  void stall_for(std::uint32_t layer, const std::vector<std::int32_t>& experts,
                 const InterruptCheck& interrupt);
  void after(std::uint32_t layer, const std::vector<std::int32_t>& chosen,
             const InterruptCheck& interrupt);
  void settle(std::uint32_t layer, const InterruptCheck& interrupt);
  void note_moce(std::uint32_t layer, std::uint32_t rows);
  void count_urgent(std::uint32_t layer, const RequestResult& r);  // hits, misses, bytes
  void add_host_time(std::uint32_t layer, const HostTimer& t);

  // ---- speculation policy ----
  // Layer `layer`'s experts the profile has seen, most popular first (ties to the lower id),
  // at most n of them.
  std::vector<std::int32_t> profile_ranked(std::uint32_t layer, std::size_t n) const;
  // New speculative reads this handshake may start: the governor's cap, or unlimited.
  std::uint32_t spec_cap() const;
  // Truncates `experts` (of `layer`) so that at most `cap` of them are unpublished, i.e. may
  // start a read; returns the cap left over (kUnlimited stays kUnlimited).
  std::uint32_t limit_new(std::vector<std::int32_t>& experts, std::uint32_t layer,
                          std::uint32_t cap) const;
  // Lookahead off: queue the profile's favourites of layer+1 as Profile reads (I9, I10).
  void queue_profile(std::uint32_t layer, std::uint32_t rows, std::uint32_t cap,
                     const InterruptCheck& interrupt);
  // Was speculation reading while the host waited for urgent reads? Brackets the wait.
  struct SpecWatch {
    std::uint64_t in_flight_before = 0, started_before = 0;
  };
  SpecWatch watch_spec() const;
  bool spec_overlapped(const SpecWatch& w) const;
  // One handshake's evidence for the governor.
  void observe_handshake(bool decode, bool missed, bool contended, std::uint64_t wall_ns);
  std::uint32_t wave_capacity() const;
  // Whether a chunk of `rows` takes the decode path (one submission, resident pass while the
  // misses are read) rather than prompt waves.
  bool takes_decode_path(std::uint32_t rows, bool routed, std::uint32_t cap) const;

  ExpertStream& stream_;
  std::unique_ptr<Backend> backend_;  // null once closed
  const std::string backend_name_;
  std::array<std::string, 3> arithmetic_why_;  // written by the constructor only, then read-only
  WindowOptions opt_;
  const PackLayout& L_;
  std::vector<float> routers_;  // [n_layers][n_experts][hidden], read once from the pack

  Scratch scratch_;  // grown to the largest chunk seen and kept (bounded by max_rows: I12)
  // Host views of the scratch the device shares (set by ensure_scratch).
  float* x_ = nullptr;
  float* out_ = nullptr;
  std::int32_t* ids_ = nullptr;
  std::int32_t* pred1_ = nullptr;
  std::int32_t* pred2_ = nullptr;
  std::int32_t* wave_ = nullptr;
  std::uint32_t* wave_n_ = nullptr;
  float* weights_ = nullptr;
  // Whether this chunk has predictions at distance 1 / 2 to use (an externally routed call may
  // bring none).
  bool chunk_pred1_ = true, chunk_pred2_ = true;
  // The rounding of this chunk's expert passes, stamped on them by submit().
  Rounding chunk_rounding_;

  // Handshake events. Values only grow: every chunk takes seq_ + 1, every prompt wave
  // wave_seq_ + 1, so a stale signal can never release a later wait.
  SharedEvent routed_, release1_, release2_, done_, wave_release_, wave_done_;
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
  ClientId client_ = kStreamClient;        // immutable after construction
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
  // The open turn ran a chunk as prompt waves (not the decode path): its scratch is
  // prompt-sized and goes back at the turn's end (unless BUF_REUSE); a turn of decode-path
  // calls, a batch of sequences included, keeps its few rows.
  bool turn_prompt_ = false;
  std::uint32_t row0_ = 0;            // first row of the chunk now running
  // predicted_[layer][chunk]: experts router `layer` chose on layer-1's input, for
  // precision/recall when that chunk reaches `layer`.
  std::vector<std::vector<std::vector<std::int32_t>>> predicted_;
  // See settle() in window.cpp.
  bool settles_ = false;
  std::vector<std::uint8_t> route_resident_;  // stats_mu_
  std::int64_t route_layer_ = -1;              // stats_mu_
};

}  // namespace strata
