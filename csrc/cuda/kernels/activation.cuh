// The fused activations of gate_up, one definition for every expert kernel (experts.cu,
// mma_experts.cu): the pack's SwiGLU or gpt-oss's clamped SwiGLU of an output row's gate and up
// dots (biases added), the CPU backend's expressions (exp within 2 ulp of the CPU's).
#pragma once

#include "device_types.h"

namespace strata::cuda {

__device__ __forceinline__ float activate_swiglu(const DevLayout& L, float g, float u) {
  if (L.activation == 0) return (g / (1.0f + expf(-g))) * u;  // silu(g) * u
  // gpt-oss: the gate clipped from above only, the linear part both ways and shifted by one.
  const float lim = L.act_limit;
  const float gc = fminf(g, lim);
  const float uc = fminf(fmaxf(u, -lim), lim);
  return (uc + 1.0f) * (gc / (1.0f + expf(-L.act_alpha * gc)));
}

}  // namespace strata::cuda
