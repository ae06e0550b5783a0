// The expert FFN's gated activation, a template parameter of gate_up and moe_mm (one struct and
// one instantiation list entry each, the mat-vec untouched), and the experts' Linear biases.
#pragma once

#include "common.h"

// SwiGLU as Qwen3-MoE, OLMoE and Mixtral use it: silu(gate) * up, written as the CPU backend
// writes it (z / (1 + exp(-z))).
struct SiluGlu {
  static float apply(constant KernelParams& p, float gate, float up) {
    (void)p;
    return gate / (1.0f + exp(-gate)) * up;
  }
};

// gpt-oss's clamped SwiGLU, as the CPU backend writes it: the gate clipped from above only, the
// linear part both ways and shifted by one; alpha and limit come from the pack.
struct SwigluOai {
  static float apply(constant KernelParams& p, float gate, float up) {
    const float alpha = as_type<float>(p.act_alpha_bits);
    const float limit = as_type<float>(p.act_limit_bits);
    const float gc = min(gate, limit);
    const float uc = min(max(up, -limit), limit);
    return (uc + 1.0f) * (gc / (1.0f + exp(-alpha * gc)));
  }
};

// A matrix's Linear bias of output row r (gpt-oss), or x unchanged without biases (so packs
// without them keep their exact bits).
inline float add_bias(constant KernelParams& p, device const uchar* rec, ulong offset, uint r,
                      float x) {
  if (p.bias_format == 0) return x;
  device const uchar* b = rec + offset;
  if (p.bias_format == 1) return x + ((device const float*)b)[r];
  if (p.bias_format == 2) return x + float(((device const half*)b)[r]);
  return x + as_type<float>(uint(((device const ushort*)b)[r]) << 16);
}

// Every activation, as (name suffix, type): gate_up and moe_gate_up instantiate each format
// with each of them.
#define STRATA_FOR_EACH_ACTIVATION(X, fmt_name, ...) \
  X(fmt_name, "silu", SiluGlu, __VA_ARGS__)          \
  X(fmt_name, "oai", SwigluOai, __VA_ARGS__)
