// Scratch: the device-visible working buffers of MoE layer calls (inputs, routed ids and weights,
// predictions, router logits, plan, expert activations and outputs), sized for a number of rows
// and wrapped into the DeviceBuffers a backend binds. Grows to the largest chunk seen, never past
// max_rows, and is kept until release(): memory stays bounded by one chunk (I12).
#pragma once

#include <cstdint>
#include <vector>

#include "exec/backend.h"
#include "residency/expert_stream.h"

namespace strata {

class Scratch {
 public:
  Scratch(const ExpertStream& stream, const float* routers);

  // Makes room for `rows`; returns true when the buffers moved (the backend must rebind).
  bool ensure(std::uint32_t rows);
  void release();  // frees everything; the next ensure() reallocates
  const DeviceBuffers& buffers() const { return b_; }
  std::uint32_t rows() const { return rows_; }
  std::uint64_t bytes() const { return bytes_; }

 private:
  const ExpertStream& stream_;
  const PackLayout& L_;
  DeviceBuffers b_;
  std::uint32_t rows_ = 0;
  std::uint64_t bytes_ = 0;
  std::vector<float> x_, weights_, logits_, h_, y_, out_, moce_moved_;
  std::vector<std::int32_t> ids_, pred_ids_[2], wave_;
  std::vector<std::uint32_t> plan_, wave_n_, moce_changed_, route_resident_;
};

}  // namespace strata
