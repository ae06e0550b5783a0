// The expert FFN's gated activation, a template parameter of gate_up and moe_mm so that new
// ones (gpt-oss's clamped SwiGLU, with its alpha and limit) slot in as one struct and one more
// instantiation list entry, without touching the mat-vec.
#pragma once

#include "common.h"

// SwiGLU as Qwen3-MoE, OLMoE and Mixtral use it: silu(gate) * up, written as the CPU backend
// writes it (z / (1 + exp(-z))).
struct SiluGlu {
  static float apply(float gate, float up) { return gate / (1.0f + exp(-gate)) * up; }
};

#define STRATA_FOR_EACH_ACTIVATION(X) X("silu", SiluGlu)
