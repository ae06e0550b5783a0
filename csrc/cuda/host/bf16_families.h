// Which instruction family the bf16 passes take (STRATA_CUDA_BF16), and the known-answer check
// that lets the default mix them: wgmma for prompt waves, mma.sync for decode.
#pragma once

#include <string>

#include "kernels/device_types.h"

namespace strata::cuda {

// The family STRATA_CUDA_BF16 asks for (auto, the default; mma; wgmma), read when a backend is
// made: a value it does not know, or wgmma where this GPU cannot run it, throws, naming why.
// Auto is returned unsettled (no kernel runs here).
Bf16Family bf16_family_asked();

// `asked` settled for this GPU: auto becomes Mma where wgmma cannot run or where the two
// families gave different bits on a known problem (then `note` says why). The check runs once
// a process (the answer is the GPU's), at the first bind of a bf16 pack: a backend that never
// runs bf16 experts never pays for it.
Bf16Family bf16_family_settled(Bf16Family asked, std::string* note);

// What the default (or STRATA_CUDA_BF16) takes on this GPU, in words, with the reason where auto
// fell back to mma.sync (strata_stream._cuda.bf16_family()).
std::string bf16_family_description();

// "" when mma.sync and wgmma give the same bits here for a known bf16 problem (prompt waves of
// float32 and of bf16-valued x on both, and mma.sync's decode tiling for the first token), else
// what differed. A token's bits alone (decode: mma.sync) and in a wave (wgmma) rest on it.
std::string bf16_families_disagree();

}  // namespace strata::cuda
