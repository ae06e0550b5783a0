// Window: one MoE layer call = plan -> handshake -> execute (docs/architecture.md section 2).
//
// The host side of the per-layer CPU/GPU handshake. Owns the backend, the routers and the
// scratch. Every chunk of a call is planned once (plan_chunk, exec/chunk_plan.h), encoded into
// backend commands and run by one of two executors (decode, waves), which drive ExpertStream at
// the host points of every layer:
//   at_layer(l):     one call per host point (decode, or each wave): protect and request the
//                    routed experts urgently, publish completed prefetches of l+1..l+2, queue
//                    the predictions behind them within one budget; then the device is released;
//   finish_layer(l): protect l+1, retire unchosen predictions of l to limbo, release limbo.
// Its parts: TurnGate (who drives it, whose turn is open), Completion (kernels still queued
// after a call returned), Speculator (what each handshake reads ahead), Recorder (figures,
// routes, profile).
//
// Threads. Every method may be called from any thread at any time; a turn belongs to the thread
// that opened it (TurnGate). The driving call alone touches the scratch, the events and the
// backend, so those need no lock; each part documents its own. close() waits for the call in
// flight, fails the open turn (the next call raises Closed), and frees the device thread, its
// worker pool, the scratch and the routers at once. Several Windows may share one ExpertStream:
// each registers its own client there and owns its protections (protection_set.h).
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "exec/adaptive_spin.h"
#include "exec/backend.h"
#include "exec/backend_support.h"
#include "exec/chunk_plan.h"
#include "exec/completion.h"
#include "exec/recorder.h"
#include "exec/routed.h"
#include "exec/scratch.h"
#include "exec/shared_event.h"
#include "exec/speculator.h"
#include "exec/turn_gate.h"
#include "exec/window_options.h"
#include "residency/expert_stream.h"

namespace strata {

class Window {
 public:
  static constexpr std::uint32_t kProfileRowsMax = Speculator::kProfileRowsMax;
  using XType = strata::XType;
  using Routed = strata::Routed;

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
  // As moe(), with the routing given (routed.h): the same handshake and expert passes on the
  // backend. x: [rows, hidden] of type xt, converted to float32 as it enters the scratch.
  // Throws EngineError(Config) with moce on (moce steers the engine's own router) and
  // std::out_of_range for an expert id outside [0, n_experts).
  void moe_routed(std::uint32_t layer, const void* x, XType xt, std::uint32_t rows,
                  const Routed& routed, float* out, const InterruptCheck& interrupt = {});
  // As moe_routed, with x and out the caller's float32 memory on the backend's device
  // ([rows, hidden] each; a torch CUDA tensor, say), read and written there by the backend. The
  // caller has finished writing x before the call. Without `stream` the call returns once out is
  // complete on the device. With the caller's stream (a cudaStream_t as an integer; 0 is the
  // legacy default stream) on a backend that completes_async(), it returns once the kernels are
  // queued, `stream` waiting for them on the device: work queued there afterwards reads out
  // complete, and the caller must not write x or out on any other stream. The layer's
  // protections then stay until the completion is retired (completion_pending()). Throws
  // EngineError(Config) where the backend cannot (device_io_unsupported()) or for a pointer
  // that is not memory of its device.
  void moe_routed_device(std::uint32_t layer, const float* x, std::uint32_t rows,
                         const Routed& routed, float* out, const InterruptCheck& interrupt = {},
                         std::optional<std::uintptr_t> stream = std::nullopt);
  // Whether the last call returned with its kernels still queued (moe_routed_device with a
  // stream): its layer's slots stay protected until the next call, begin_turn, end_turn or
  // close drains the backend (completion.h).
  bool completion_pending() const { return completion_.pending(); }
  // Why this Window's backend cannot run moe_routed_device / return per-entry outputs
  // (Routed::per_entry); "" when it can.
  const std::string& device_io_unsupported() const { return support_.device_io; }
  const std::string& per_entry_unsupported() const { return support_.per_entry; }
  // The caller computes the experts (the MLX-kernel path): the same handshake, with nothing
  // submitted to this Window's device, then for every wave compute(row0, rows, slots) with
  // slots[rows * top_k] the arena slot of each entry of rows [row0, row0 + rows) whose expert
  // is in the wave, kAbsent for the others. Those slots hold their experts (published,
  // protected and, with several waves, pinned: I4, I8) until compute returns. Every entry
  // appears in exactly one wave.
  using WaveCompute =
      std::function<void(std::uint32_t row0, std::uint32_t rows, const std::uint32_t* slots)>;
  void moe_routed_external(std::uint32_t layer, std::uint32_t rows, const Routed& routed,
                           const WaveCompute& compute, const InterruptCheck& interrupt = {});
  // Which predictions (router l+1, l+2 on layer l's input) an externally routed call of `rows`
  // rows at `layer` uses: the plan's one decision (call_lookahead), less the predictions of a
  // layer that can do nothing (every expert of it published for good: Speculator::useful).
  Lookahead wants_predictions(std::uint32_t layer, std::uint32_t rows) const;
  // Moves the turn past `layer`, which this pass runs no rows of (a decoder layer with several
  // experts sets, one pack layer each, whose pass's tokens chose none of this one: the turn's
  // layer order holds every pack layer). The layer's after-layer host point runs with nothing
  // chosen, so its predicted reads go to limbo (I7) and layer+1 is protected next (I4); the
  // turn opens at layer 0 and ends after layer L-1 as with a call of rows. Turn error out of
  // order, as a call's.
  void pass_layer(std::uint32_t layer, const InterruptCheck& interrupt = {});

  // Opens an explicit turn (ending an implicit one of this thread). Turn error if one is open.
  void begin_turn();
  // Ends this thread's turn; nothing when no turn is open or the Window is closed.
  void end_turn();
  // Waits for the call in flight (another thread's), fails the open turn, releases the stream's
  // protections, the device thread and its pool, the scratch and the routers. Idempotent; safe
  // from several threads at once. Figures (stats, profile, routes) stay readable.
  void close();
  bool closed() const { return gate_.closed(); }
  bool in_turn() const { return gate_.in_turn(); }
  std::uint32_t next_layer() const { return gate_.next_layer(); }

  // Figures (recorder.h), from any thread.
  std::vector<LayerStats> layer_stats() const { return recorder_.layer_stats(); }
  // Routed choices since the last call, as (token, layer, expert) triples, in the order the
  // engine met them. Tokens count from the first call.
  std::vector<std::int32_t> take_routes() { return recorder_.take_routes(); }
  // Expert popularity, learned online: tokens that chose each (layer, expert), [L * E].
  std::vector<std::uint32_t> profile() const { return recorder_.profile(); }
  // Size must be L * E. Not while another thread's turn is open (Turn error).
  void set_profile(const std::vector<std::uint32_t>& counts);
  void reset_stats() { recorder_.reset_stats(); }
  const WindowOptions& options() const { return opt_; }
  const PackLayout& layout() const { return L_; }
  // The residency the last moce route read (1 = smap held a slot), for the layer it routed;
  // empty until a moce route ran.
  std::vector<std::uint8_t> route_resident() const { return recorder_.route_resident(); }
  std::int64_t route_layer() const { return recorder_.route_layer(); }
  // Whether this Window settles IO before host points so that moce routing is deterministic.
  bool settles() const { return speculator_.settles(); }
  PrefetchGovernor governor() const { return speculator_.governor(); }  // a snapshot
  std::string backend_name() const { return backend_name_; }
  std::string backend_tuning() const { return backend_tuning_; }
  // Why this Window's backend cannot compute its pack's expert passes in `a` (at `layer`'s
  // format class; every layer's without one); "" when it can (asked once at construction).
  const std::string& arithmetic_unsupported(Arithmetic a) const {
    return support_.arithmetic[std::size_t(a)];
  }
  const std::string& arithmetic_unsupported(Arithmetic a, std::uint32_t layer) const {
    return support_.class_arithmetic[L_.class_of(layer)][std::size_t(a)];
  }
  std::uint64_t scratch_bytes() const { return scratch_.bytes(); }
  ClientId client() const { return client_; }  // this Window's protections in the stream

 private:
  // Checks turn order, runs chunk(r0, n, index) over the call's chunks of at most max_rows rows
  // (each leaves the experts it chose in buf_.chosen), then the after-layer host point. Any
  // error abandons the turn with the stream usable. queued: the chunks return with their
  // kernels queued (queued_done).
  using ChunkFn = std::function<void(std::uint32_t r0, std::uint32_t n, std::uint32_t chunk)>;
  // ---- turns and the pending completion (window.cpp tells each one's part) ----
  void finish_turn();
  void end_turn_in_stream(bool prompt);
  Completion::State drain();
  void retire_completion();
  void raise_device_error();
  bool keep_queued_chunk(const ChunkPlan& p);
  void abandon_call();
  void teardown();
  // ---- plan -> handshake -> execute ----
  // pass: pass_layer's (rows 0, nothing to run, the turn still moves on).
  void run_call(std::uint32_t layer, std::uint32_t rows, const ChunkFn& chunk,
                const InterruptCheck& interrupt, bool queued = false, bool pass = false);
  ChunkPlan plan(CallKind kind, std::uint32_t layer, std::uint32_t r0, std::uint32_t rows,
                 std::uint32_t distinct = 0, const Routed* routed = nullptr,
                 bool queued_done = false) const;
  // One planned chunk: the first submission, then the plan's executor; leaves its experts in
  // buf_.chosen, most popular first. compute: the caller's expert pass (CallKind::External).
  void run_chunk(const ChunkPlan& p, std::uint32_t chunk, const InterruptCheck& interrupt,
                 const WaveCompute* compute = nullptr);
  void run_decode(const ChunkPlan& p, std::uint32_t chunk, std::uint64_t v, bool keep,
                  Clock::time_point start, const InterruptCheck& interrupt);
  void run_waves(const ChunkPlan& p, std::uint32_t chunk, std::uint64_t v,
                 std::uint64_t first_wave, bool keep, Clock::time_point start,
                 const InterruptCheck& interrupt, const WaveCompute* compute);
  // One wave's handshake and pass; returns whether its urgent reads missed, and whether
  // speculation read meanwhile (`contended`).
  bool run_wave(const ChunkPlan& p, std::uint32_t chunk, std::uint32_t w, std::uint32_t n_waves,
                bool keep, const InterruptCheck& interrupt, const WaveCompute* compute,
                bool& contended);
  void compute_wave(const ChunkPlan& p, const std::int32_t* wave, std::size_t n, bool multi,
                    const WaveCompute& compute);
  // Learns the chunk's routing (profile, routes; its precision into `d`) and leaves its experts
  // in buf_.chosen, most popular first.
  void read_routing(const ChunkPlan& p, std::uint32_t chunk, LayerStats& d);
  void wait_device(SharedEvent& ev, std::uint64_t v, const InterruptCheck& interrupt,
                   AdaptiveSpin& spin);
  void stall_for(std::uint32_t layer, const std::int32_t* experts, std::size_t n,
                 const InterruptCheck& interrupt);
  // The after-layer host point of a call of `rows` rows that chose `chosen`.
  void after(std::uint32_t layer, std::uint32_t rows, const std::vector<std::int32_t>& chosen,
             const InterruptCheck& interrupt);
  void count_urgent(const RequestResult& r, LayerStats& d) const;  // hits, misses, bytes
  std::uint32_t wave_capacity() const;

  ExpertStream& stream_;
  std::unique_ptr<Backend> backend_;  // null once closed
  const std::string backend_name_, backend_tuning_;
  // How long wait_device may spin before it blocks (the backend's host_spin(), read once), and
  // whether it does, learned per wait site.
  const std::chrono::microseconds host_spin_;
  AdaptiveSpin spin_routed_, spin_wave_, spin_done_;
  const PackLayout& L_;
  const BackendSupport support_;  // the constructor's answers, read-only after
  const WindowOptions opt_;       // validated
  std::vector<float> routers_;  // [n_layers][n_experts][hidden], read once from the pack
  const PlanRules rules_;       // what plan_chunk decides by

  // The driving call's (TurnGate's busy holder's): the scratch (grown to the largest chunk seen,
  // bounded by max_rows: I12; its size readable from any thread) and the working lists, reused
  // from chunk to chunk so that a warm layer call allocates nothing.
  Scratch scratch_;
  Popularity popularity_;
  struct ChunkBuffers {
    std::vector<Command> commands;          // the submission being encoded
    std::vector<std::int32_t> chosen;       // this chunk's distinct experts, most popular first
    std::vector<std::int32_t> call_chosen;  // the call's distinct experts, in chunk order
    std::vector<char> seen;                 // [n_experts] run_call's marks, zero between calls
    std::vector<char> marks;                // [n_experts] union counts' marks, kept zero
    std::vector<std::uint32_t> wave_slots;  // the wave's experts' slots (plan_slots)
    std::vector<std::uint32_t> slot_of;     // [n_experts] expert -> slot this wave, else kAbsent
    std::vector<std::uint32_t> entry_slots; // [rows * top_k] the slots compute() is given
  } buf_;
  // The open turn ran a chunk off the decode path (prompt waves): its scratch is prompt-sized
  // and goes back at the turn's end (unless BUF_REUSE).
  bool turn_prompt_ = false;
  // The recorder's pass has begun (its first call with rows): a pass whose first pack layers
  // were passed (pass_layer) begins at its first call that runs rows.
  bool pass_begun_ = false;
  // Handshake events. Values only grow: every chunk takes seq_ + 1, every prompt wave
  // wave_seq_ + 1, so a stale signal can never release a later wait.
  SharedEvent routed_, release1_, release2_, done_, wave_release_, wave_done_;
  const HandshakeEvents events_{&routed_, &release1_, &release2_, &done_, &wave_release_,
                                &wave_done_};
  std::uint64_t seq_ = 0, wave_seq_ = 0;

  TurnGate gate_;           // its own lock
  Completion completion_;   // moved by the driving call, read from any thread (atomic)
  Recorder recorder_;       // its own lock
  Speculator speculator_;   // the driving call's; its governor snapshot under its own lock
  ClientId client_ = kStreamClient;  // immutable after construction
  // The backend's record observer registered with the stream, from construction until
  // teardown(), which removes it (waiting out an IO thread inside it) before the backend goes.
  std::optional<ObserverId> observer_;
};

}  // namespace strata
