// A failed CUDA runtime call as the host files report it: an exception naming the call and the
// error, with the runtime's last error cleared first, so a later cudaGetLastError does not
// report the same failure again.
#pragma once

#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>

namespace strata::cuda {

inline std::string cuda_message(const char* what, cudaError_t e) {
  return std::string("cuda: ") + what + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) +
         ")";
}

inline void cuda_check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  cudaGetLastError();
  throw std::runtime_error(cuda_message(what, e));
}

}  // namespace strata::cuda
