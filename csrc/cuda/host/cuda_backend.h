// The CUDA backend (docs/cuda.md). A device thread takes the Window's commands in order, like
// the CPU backend's: kernels are launched on one CUDA stream; a Signal first brings the host
// what the host reads (ids, predictions, out) and waits for the stream, then signals; a Wait
// blocks the device thread on the SharedEvent, so nothing behind it is launched before the host
// releases it (host-paced: the handshake as the GPU sees it is a gap in the stream).
//
// Memory (the mapped mode): the arena and smap are the stream's own host pages, registered and
// mapped into the GPU, so an expert is read by the kernels exactly where the IO threads put it
// and only through smap or the plan's snapshot of it (I1-I8 hold as on the CPU, see
// docs/architecture.md); routers and scratch are device memory.
#pragma once

#include <memory>
#include <string>

#include "exec/backend.h"

namespace strata::cuda {

// Why no CUDA device can run the backend ("" when one can).
std::string unavailable();
// Throws std::runtime_error naming the cause when no device can.
std::unique_ptr<Backend> make_cuda_backend();
// The tuning a backend made now would take from the environment (STRATA_CUDA_*), as one line
// of NAME=value pairs: what a backend prints at start when STRATA_CUDA_TRACE is set, for a
// module's stats to show beside the run's numbers.
std::string tuning_description();

}  // namespace strata::cuda
