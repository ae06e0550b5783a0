#include "exec/routed.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "common/errors.h"
#include "pack/weights.h"

namespace strata {

void load_x(const void* x, XType xt, std::size_t first, std::size_t n, float* dst) {
  switch (xt) {
    case XType::F32:
      std::memcpy(dst, static_cast<const float*>(x) + first, n * 4);
      return;
    case XType::F16:
    case XType::BF16: {
      const auto* src = static_cast<const std::uint16_t*>(x) + first;
      for (std::size_t i = 0; i < n; ++i)
        dst[i] = xt == XType::F16 ? half_to_float(src[i]) : bf16_to_float(src[i]);
      return;
    }
  }
}

void check_routed(const Routed& routed, std::uint32_t layer, std::uint32_t rows,
                  bool need_weights, const PackLayout& layout, const BackendSupport& support,
                  MoceMode moce) {
  if (moce != MoceMode::Off)
    throw EngineError(ErrorKind::Config,
                      "moce steers the engine's own router; an externally routed call "
                      "(moe_routed) needs moce off");
  const std::size_t a = std::size_t(routed.rounding.arithmetic);
  if (const std::string& why = layer < layout.n_layers
                                   ? support.class_arithmetic[layout.class_of(layer)][a]
                                   : support.arithmetic[a];
      !why.empty())
    throw EngineError(ErrorKind::Config, why);
  if (routed.per_entry && !support.per_entry.empty())
    throw EngineError(ErrorKind::Config, support.per_entry);
  if (rows == 0) return;
  if (!routed.ids || (need_weights && !routed.weights))
    throw std::invalid_argument("moe_routed needs ids and weights");
  const std::size_t n = std::size_t(rows) * layout.top_k;
  for (const std::int32_t* ids : {routed.ids, routed.pred1, routed.pred2}) {
    if (!ids) continue;
    for (std::size_t i = 0; i < n; ++i)
      if (ids[i] < 0 || std::uint32_t(ids[i]) >= layout.n_experts)
        throw std::out_of_range("expert id " + std::to_string(ids[i]) + " at entry " +
                                std::to_string(i) + " out of range [0, " +
                                std::to_string(layout.n_experts) + ")");
  }
}

std::uint32_t stage_routed(const Routed& routed, std::uint32_t top_k, std::uint32_t r0,
                           std::uint32_t rows, const DeviceBuffers& b, std::vector<char>& marks) {
  const std::size_t first = std::size_t(r0) * top_k, count = std::size_t(rows) * top_k;
  const std::int32_t* src = routed.ids + first;
  std::uint32_t distinct = 0;
  for (std::size_t i = 0; i < count; ++i) {  // the copy counts the union as it goes
    const std::int32_t e = src[i];
    b.ids[i] = e;
    if (!marks[std::size_t(e)]) {
      marks[std::size_t(e)] = 1;
      ++distinct;
    }
  }
  for (std::size_t i = 0; i < count; ++i) marks[std::size_t(b.ids[i])] = 0;
  if (routed.weights) std::copy(routed.weights + first, routed.weights + first + count, b.weights);
  if (routed.pred1) std::copy(routed.pred1 + first, routed.pred1 + first + count, b.pred_ids[0]);
  if (routed.pred2) std::copy(routed.pred2 + first, routed.pred2 + first + count, b.pred_ids[1]);
  return distinct;
}

ChunkDeviceIo::ChunkDeviceIo(Backend& b, const DeviceIo& io) : b_(b) {
  try {
    b_.set_device_io(io);
  } catch (const std::invalid_argument& e) {
    throw EngineError(ErrorKind::Config, e.what());
  }
}

ChunkDeviceIo::~ChunkDeviceIo() {
  try {
    b_.set_device_io({});
  } catch (...) {  // {} names no pointer: nothing to refuse
  }
}

}  // namespace strata
