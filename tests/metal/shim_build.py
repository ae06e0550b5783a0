"""Builds the Metal-kernel emulator harness (tests/metal/shim_harness.cpp) for the tests.

The .metal sources compile as C++20 against tests/metal/shim/ and link with the CPU backend's
kernels, so one executable runs every operation on both. Objects are cached by content hash in
a directory outside the worktree (STRATA_METAL_SHIM_CACHE, else the system temp dir), so only
the first session on a machine pays the compile; a changed source rebuilds just its object.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
METAL = ROOT / "csrc" / "metal"
KERNELS = METAL / "kernels"
# The emulator runtime and the type-check prelude: test equipment, not part of the product.
SHIM = ROOT / "tests" / "metal" / "shim"
ENGINE = ROOT / "csrc" / "engine"
ENGINE_SOURCES = [
    ENGINE / "pack" / "pack_file.cpp",
    ENGINE / "pack" / "weights.cpp",
    ENGINE / "cpu" / "cpu_kernels.cpp",
    ENGINE / "cpu" / "mlx_kernels.cpp",
    ENGINE / "policy" / "moce.cpp",
]
FLAGS = ["-std=c++20", "-O2", "-pthread", "-Wall", "-Wno-attributes", "-Wno-unknown-pragmas"]


def compiler() -> str:
    for name in (os.environ.get("CXX", ""), "g++", "clang++-19", "clang++", "c++"):
        if name and shutil.which(name):
            return name
    raise RuntimeError("no C++ compiler found (set CXX)")


def cache_dir() -> Path:
    base = os.environ.get("STRATA_METAL_SHIM_CACHE") or str(
        Path(tempfile.gettempdir()) / f"strata-metal-shim-{os.getuid()}"
    )
    path = Path(base)
    path.mkdir(parents=True, exist_ok=True)
    return path


def metal_sources(kernels: Path = KERNELS) -> list[Path]:
    return sorted(kernels.glob("*.metal"))


def _headers_digest(kernels: Path) -> str:
    h = hashlib.sha256()
    for folder in (kernels, SHIM, METAL / "host", ENGINE):
        for f in sorted(folder.rglob("*.h")):
            h.update(f.name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def _compile(
    cxx: str, src: Path, headers: str, out_dir: Path, extra: list[str], kernels: Path = KERNELS
) -> Path:
    h = hashlib.sha256()
    h.update(" ".join([cxx, *FLAGS, *extra]).encode())
    h.update(headers.encode())
    h.update(src.name.encode())  # not the folder: a planted copy reuses the other objects
    h.update(src.read_bytes())
    obj = out_dir / f"{src.stem}-{h.hexdigest()[:16]}.o"
    if obj.exists():
        return obj
    lang = ["-x", "c++"] if src.suffix == ".metal" else []
    tmp = obj.with_suffix(f".{os.getpid()}.tmp")
    includes = ["-I", str(ENGINE), "-I", str(SHIM), "-I", str(kernels)]
    cmd = [cxx, *FLAGS, *extra, *includes, "-c", *lang, str(src), "-o", str(tmp)]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"compiling {src} failed:\n{' '.join(cmd)}\n{run.stderr}")
    tmp.replace(obj)
    return obj


def build_harness(kernels: Path = KERNELS, name: str = "shim_harness") -> Path:
    """Compile (or reuse) every object and link the harness; returns the executable's path.

    `kernels` may be a modified copy of csrc/metal/kernels (the planted-change test).
    """
    cxx = compiler()
    out = cache_dir()
    headers = _headers_digest(kernels)
    kernel_files = metal_sources(kernels)
    sources = [
        *ENGINE_SOURCES,
        SHIM / "msl_runtime.cpp",
        METAL / "host" / "dispatch_plan.cpp",
        ROOT / "tests" / "metal" / "shim_harness.cpp",
    ]
    with ThreadPoolExecutor(max_workers=2) as pool:
        objs = list(
            pool.map(
                lambda s: _compile(cxx, s, headers, out, [], kernels), [*kernel_files, *sources]
            )
        )
    link = hashlib.sha256("".join(str(o) for o in objs).encode()).hexdigest()[:16]
    exe = out / f"{name}-{link}"
    if not exe.exists():
        tmp = exe.with_suffix(f".{os.getpid()}.tmp")
        cmd = [cxx, *FLAGS, *map(str, objs), "-lz", "-o", str(tmp)]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"linking the shim harness failed:\n{run.stderr}")
        tmp.replace(exe)
    return exe


def build_program(name: str, sources: list[Path], extra: list[str]) -> Path:
    """A small test program from `sources` (with `extra` flags, e.g. a sanitizer), cached by
    content hash like the harness."""
    cxx = compiler()
    out = cache_dir()
    h = hashlib.sha256(" ".join([cxx, *FLAGS, *extra]).encode())
    h.update(_headers_digest(KERNELS).encode())
    for src in sources:
        h.update(src.read_bytes())
    exe = out / f"{name}-{h.hexdigest()[:16]}"
    if not exe.exists():
        tmp = exe.with_suffix(f".{os.getpid()}.tmp")
        includes = ["-I", str(ENGINE), "-I", str(SHIM), "-I", str(KERNELS)]
        cmd = [cxx, *FLAGS, *extra, *includes, *map(str, sources), "-o", str(tmp)]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"building {name} failed:\n{' '.join(cmd)}\n{run.stderr}")
        tmp.replace(exe)
    return exe
