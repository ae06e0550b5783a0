// The plan of one chunk of a MoE layer call (docs/architecture.md section 2), and the backend
// commands that carry it out.
//
// A layer call is cut into chunks of at most max_rows rows; each chunk is planned once, before
// anything runs, by plan_chunk: which executor runs it (decode: a resident and a missing pass
// around the urgent reads; waves: every expert of a wave resident before the wave runs), how
// many experts a wave holds, which predictions (router l+1, l+2) the handshake uses, the one
// speculation budget they share, and whether anything runs on the device before the host point.
// plan_chunk and the encode functions are pure: they read their arguments only, so the rules can
// be tested without a backend or a stream (tests/cpp/test_chunk_plan.cpp).
#pragma once

#include <cstdint>
#include <vector>

#include "exec/backend.h"
#include "exec/shared_event.h"

namespace strata {

// Who routes a chunk and who computes its experts.
enum class CallKind : std::uint8_t {
  Engine,    // moe(): the backend routes (Route, RoutePredict) and computes the experts
  Routed,    // moe_routed(): the caller routes, the backend computes the experts
  External,  // moe_routed_external(): the caller routes and computes the experts (MLX kernels)
};

// Which executor runs a chunk.
enum class Executor : std::uint8_t {
  Decode,  // one handshake; the resident pass overlaps the urgent reads, then the missing pass
  Waves,   // a handshake per wave; every expert of a wave is resident before it runs
};

// Which predictions a call uses: router l+1 and router l+2 on layer l's input.
struct Lookahead {
  bool next = false;        // distance 1 (STRATA lookahead)
  bool two_layer = false;   // distance 2 (STRATA_METAL_PREFETCH2 / STRATA_METAL_PROMPT_PRED2)
  bool operator==(const Lookahead&) const = default;
};

// The Window's fixed facts plan_chunk decides by (its options and its pack's geometry).
struct PlanRules {
  std::uint32_t n_layers = 0, n_experts = 0, top_k = 0;
  bool lookahead = true;            // router l+1 (both sizes)
  bool two_layer_decode = false;    // STRATA_METAL_PREFETCH2: router l+2 for decode-sized chunks
  bool two_layer_prompt = false;    // STRATA_METAL_PROMPT_PRED2: router l+2 for larger chunks
  std::uint32_t two_layer_max = 64; // STRATA_METAL_PROMPT_PRED2_MAX: new l+2 reads per handshake
  std::uint32_t decode_rows = 4;    // a chunk of at most this many rows (whose experts fit) is decode-sized
  // A routed chunk of at most this many rows (B sequences decoding together) also takes the
  // decode path while the union of its rows' experts fits one wave: its ids are known before
  // anything is submitted, so the bound is the union, not rows * top_k.
  std::uint32_t decode_batch_rows = 64;
  bool split_turn = false;          // every step its own submission
  MoceParams moce;                  // the engine's own route (CallKind::Engine only)
};

// One chunk as the caller asks for it.
struct ChunkRequest {
  CallKind kind = CallKind::Engine;
  std::uint32_t layer = 0;
  std::uint32_t row0 = 0;  // first row of the chunk within the call
  std::uint32_t rows = 0;
  // Routing given by the caller: whether it brought predictions at distance 1 / 2.
  bool has_pred1 = true, has_pred2 = true;
  Rounding rounding;  // the expert passes' (CallKind::Routed)
  // Routed and External: how many distinct experts the chunk's rows chose (0: not known, the
  // engine routes on the device).
  std::uint32_t distinct_experts = 0;
  // Routed: the chunk may complete queued (a chunk of a routed call on device memory whose
  // caller's stream waits for its output, on a backend that completes_async()).
  bool queued_done = false;
};

struct ChunkPlan {
  CallKind kind = CallKind::Engine;
  Executor executor = Executor::Decode;
  std::uint32_t layer = 0, row0 = 0, rows = 0;
  // Rows and experts small enough for the decode lookahead rule (also on the external path,
  // whose executor is always Waves: the host computes in waves whatever the size).
  bool decode_sized = false;
  // Decode-sized, or a routed batch whose union of experts fits a wave: the decode path (also
  // on the external path, where it decides only that the turn's scratch is decode-sized).
  bool decode_path = false;
  std::uint32_t wave_capacity = 0;  // experts per wave: the Window's share of the arena
  std::uint32_t max_waves = 0;      // Waves on the device: encoded up front in one-piece mode
  Lookahead predict;                // what the handshake uses (I10: never beyond the last layer)
  // New speculative reads this handshake may start, for every speculative class together
  // (Pred1, then Pred2, then Profile), PrefetchGovernor::kUnlimited for no cap.
  std::uint32_t spec_budget = 0;
  std::uint32_t two_layer_max = 0;  // the further cap on Pred2's share of spec_budget
  bool split = false;               // every step its own submission
  // Whether the chunk's first submission has any device work before the host point (routing,
  // or in one-piece mode the expert steps waiting on their events). When not, the Window
  // neither submits it nor waits for it: an externally routed chunk costs no device round trip.
  bool device_before_host = false;
  // The chunk's done Signal is raised once its kernels are queued (Command::queued), and so is
  // its wave's wave_done when it has one wave (max_waves 1): the Window's pending completion
  // then holds its protections until the backend drained. Such a
  // chunk's first submission signals nothing before the host point either (its ids came from
  // the host; nothing runs on the device that the host point needs), so the host does not
  // wait for the device before at_layer.
  bool queued_done = false;
  // Whether the first submission signals `routed` and the host waits for it (Engine: the ids
  // are there then; Routed in one piece: a round trip, unless queued_done).
  bool routed_signal = false;
  Rounding rounding;
  MoceParams moce;

  // Waves a chunk that chose `n_chosen` distinct experts runs in (Decode: 1).
  std::uint32_t waves(std::size_t n_chosen) const {
    if (executor == Executor::Decode) return 1;
    return std::uint32_t((n_chosen + wave_capacity - 1) / wave_capacity);
  }
};

// Plans one chunk: pure. wave_capacity: the experts one wave may hold (Window::wave_capacity);
// spec_budget: the governor's cap on new speculative reads at this handshake.
ChunkPlan plan_chunk(const PlanRules& rules, const ChunkRequest& request,
                     std::uint32_t wave_capacity, std::uint32_t spec_budget);

// The predictions a call of `rows` rows at `layer` uses, for a caller that brings them
// (every chunk of max_rows rows or fewer, together): what Window::wants_predictions says.
Lookahead call_lookahead(const PlanRules& rules, std::uint32_t layer, std::uint32_t rows,
                         std::uint32_t max_rows, std::uint32_t wave_capacity);

// The handshake events of one Window, in the order a chunk meets them.
struct HandshakeEvents {
  SharedEvent* routed = nullptr;        // device -> host: ids (and predictions) are in scratch
  SharedEvent* release_resident = nullptr;  // host -> device: the resident pass may run
  SharedEvent* release_missing = nullptr;   // host -> device: the missing pass may run
  SharedEvent* done = nullptr;          // device -> host: the chunk's output is in scratch
  SharedEvent* wave_release = nullptr;  // host -> device: this wave's experts are resident
  SharedEvent* wave_done = nullptr;     // device -> host: the wave ran
};

// The steps a split-turn chunk submits one by one, each as its own submission.
enum class Step : std::uint8_t {
  ResidentPass,  // Decode: plan, then the resident experts' gate_up and down
  MissingPass,   // Decode: the missing experts' passes, combine, signal done
  Wave,          // Waves: one grouped matmul over the wave, signal wave_done
  Finish,        // Waves: combine, signal done
};

// The chunk's first submission into `out` (cleared first): route and predictions (Engine), the
// routed signal, and in one-piece mode every later step behind its event wait. `chunk_value`
// is the chunk's value of routed/release/done; `first_wave` the wave events' value of its
// first wave. Empty when plan.device_before_host is false.
void encode_chunk(const ChunkPlan& plan, const HandshakeEvents& ev, std::uint64_t chunk_value,
                  std::uint64_t first_wave, std::vector<Command>& out);
// One split-turn step into `out` (cleared first); `value` is the event value it signals
// (done for Decode and Finish, wave_done for Wave).
void encode_step(const ChunkPlan& plan, Step step, const HandshakeEvents& ev, std::uint64_t value,
                 std::vector<Command>& out);

}  // namespace strata
