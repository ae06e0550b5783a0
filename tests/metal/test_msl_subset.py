"""The kernels stay inside the MSL subset the emulator models (tests/metal/msl_subset.py)."""

from __future__ import annotations

from msl_subset import kernel_sources, metal_view, violations
from shim_build import KERNELS


def test_kernel_sources_use_only_the_modelled_subset() -> None:
    sources = kernel_sources(KERNELS)
    assert len([n for n in sources if n.endswith(".metal")]) >= 7
    assert violations(sources) == []


def test_lint_rejects_builtins_the_shim_does_not_model() -> None:
    bad = """#include "common.h"
template <class U> [[kernel]] void k(STRATA_KERNEL_PARAMS) {
  threadgroup float tmp[32];
  float v = simd_shuffle_down(out[0], 1u);
  out[0] = sqrt(v) + fast::exp(v) + [[early]] 0;
}"""
    found = "\n".join(violations({**kernel_sources(KERNELS), "bad.metal": bad}))
    for name in ("threadgroup", "simd_shuffle_down", "sqrt", "fast", "[[early]]"):
        assert f"bad.metal: '{name}'" in found or f"[[{name.strip('[]')}]]" in found, name


def test_lint_sees_what_the_metal_compiler_sees() -> None:
    text = """#ifdef __METAL_VERSION__
metal_line
#else
shim_line
#endif
#ifndef STRATA_MSL_TYPECHECK
emulator_line
#endif
#if defined(__METAL_VERSION__)
metal_again
#elif defined(STRATA_MSL_TYPECHECK)
typecheck_line
#else
other_line
#endif"""
    # STRATA_MSL_TYPECHECK is undefined for Metal, so its #ifndef branch is Metal's too.
    assert metal_view(text).split() == ["metal_line", "emulator_line", "metal_again"]
