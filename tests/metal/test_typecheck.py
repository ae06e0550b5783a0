"""Every .metal file type-checks as C++ with clang under the address-space prelude
(tests/metal/shim/msl_prelude.h, STRATA_MSL_TYPECHECK): device, constant and threadgroup are
distinct clang address spaces, so a pointer used in the wrong one fails here as it would under
the Metal compiler. Needs clang (CI installs clang-19); skipped without it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from shim_build import KERNELS, SHIM, metal_sources

CLANG = next((c for c in ("clang++-19", "clang++") if shutil.which(c)), None)
pytestmark = pytest.mark.skipif(CLANG is None, reason="needs clang++ (clang-19 in CI)")
FLAGS = [
    "-fsyntax-only",
    "-x",
    "c++",
    "-std=c++20",
    "-DSTRATA_MSL_TYPECHECK",
    "-Werror",
    "-Wall",
    "-Wextra",
    "-Wno-unused-parameter",
    "-Wno-unknown-attributes",
]


def typecheck(src: Path) -> subprocess.CompletedProcess[str]:
    assert CLANG is not None
    return subprocess.run(
        [CLANG, *FLAGS, "-I", str(KERNELS), "-I", str(SHIM), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("src", metal_sources(), ids=lambda p: p.name)
def test_kernel_file_typechecks(src: Path) -> None:
    r = typecheck(src)
    assert r.returncode == 0, r.stderr


# The same kernel twice: once reading x through a helper that takes a device pointer, once
# through one that takes a thread (private) pointer. Only the address space differs.
_KERNEL = """#include "common.h"
inline float first({space} const float* v) {{ return v[0]; }}
template <class Unused>
[[kernel]] void probe(STRATA_KERNEL_PARAMS) {{ out[0] = first(x); }}
STRATA_KERNEL("probe", probe, void)
"""


def test_wrong_address_space_is_rejected(tmp_path: Path) -> None:
    good, bad = tmp_path / "good.metal", tmp_path / "bad.metal"
    good.write_text(_KERNEL.format(space="device"))
    bad.write_text(_KERNEL.format(space="thread"))
    assert typecheck(good).returncode == 0, typecheck(good).stderr
    r = typecheck(bad)
    assert r.returncode != 0
    assert "address space" in r.stderr or "no matching function" in r.stderr, r.stderr


def test_writing_through_constant_is_rejected(tmp_path: Path) -> None:
    src = tmp_path / "write_constant.metal"
    src.write_text(
        _KERNEL.format(space="device").replace(
            "out[0] = first(x);", "out[0] = first(x); p.rows = 0u;"
        )
    )
    r = typecheck(src)
    assert r.returncode != 0 and ("p.rows" in r.stderr or "read-only" in r.stderr), r.stderr


@pytest.mark.skipif(shutil.which("cmake") is None, reason="needs cmake")
def test_embedded_source_is_one_self_contained_unit(tmp_path: Path) -> None:
    """The newLibraryWithSource fallback compiles the kernels as one text with the local
    #includes removed (csrc/metal/embed_kernels.cmake); it must still type-check, and hold
    every kernel instantiation list."""
    out = tmp_path / "embedded.cpp"
    subprocess.run(
        [
            "cmake",
            f"-DOUT={out}",
            f"-DKERNELS={KERNELS}",
            "-P",
            str(KERNELS.parent / "embed_kernels.cmake"),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    text = out.read_text()
    source = text.split('R"STRATA_MSL(', 1)[1].rsplit(')STRATA_MSL"', 1)[0]
    assert '#include "' not in source
    for src in metal_sources():
        assert f"// ---- {src.name}" in source
    unit = tmp_path / "embedded.metal"
    unit.write_text(source)
    assert CLANG is not None
    prelude = SHIM / "msl_prelude.h"
    r = subprocess.run(
        [CLANG, *FLAGS, "-include", str(prelude), str(unit)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
