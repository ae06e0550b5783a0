// An externally routed call's inputs (docs/architecture.md section 2): the model routes with its
// own gate, and the Window takes its ids, mixture weights and predictions. The engine checks
// their meaning once (check_routed_ids) and converts them once, chunk by chunk, into the scratch
// the backend reads (stage_routed); nothing reads the caller's tables after that.
#pragma once

#include <cstdint>
#include <vector>

#include "exec/backend.h"
#include "exec/backend_support.h"

namespace strata {

// The element type of a routed call's x.
enum class XType : std::uint8_t { F32, F16, BF16 };

// One call's routing, [rows, top_k] each, row-major. pred1/pred2: the model's gates of layers
// l+1 / l+2 applied to this layer's input (null: no prediction at that distance), used as
// Window::wants_predictions says.
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
  // (Window::per_entry_unsupported()).
  bool per_entry = false;
};

// x[first, first + n) of type xt into dst as float32.
void load_x(const void* x, XType xt, std::size_t first, std::size_t n, float* dst);

// A routed call of `rows` rows at `layer`, before anything runs: EngineError(Config) with moce
// on (moce steers the engine's own router) or for an arithmetic or per-entry output the backend
// cannot give (`support`); std::invalid_argument without ids (or weights, need_weights); and
// std::out_of_range for an id of ids, pred1 or pred2 outside [0, n_experts), naming the entry.
// (A layer out of range is the call's to refuse, naming the range.)
void check_routed(const Routed& routed, std::uint32_t layer, std::uint32_t rows,
                  bool need_weights, const PackLayout& layout, const BackendSupport& support,
                  MoceMode moce);

// Rows [r0, r0 + rows) of the routing into the scratch `b` (ids, weights, predictions): the one
// copy. Returns how many distinct experts the rows chose (the plan's union), counted with
// `marks` ([n_experts], zero before and after).
std::uint32_t stage_routed(const Routed& routed, std::uint32_t top_k, std::uint32_t r0,
                           std::uint32_t rows, const DeviceBuffers& b, std::vector<char>& marks);

// Points the backend at one chunk's device rows for as long as it lives; the scratch again after
// (also when the chunk throws: the next call may be a host one). A pointer the backend refuses
// (not its device's memory) is the caller's mistake: EngineError(Config).
class ChunkDeviceIo {
 public:
  ChunkDeviceIo(Backend& b, const DeviceIo& io);
  ~ChunkDeviceIo();
  ChunkDeviceIo(const ChunkDeviceIo&) = delete;
  ChunkDeviceIo& operator=(const ChunkDeviceIo&) = delete;

 private:
  Backend& b_;
};

}  // namespace strata
