"""llama.cpp from a pinned source, built for the peer comparison (benchmarks/peers/run.py).

    python benchmarks/peers/llama_build.py [--workdir DIR] [--cuda]

The source is the llama-cpp-python sdist below (it vendors llama.cpp with its
convert_hf_to_gguf.py, gguf-py and llama-quantize), fetched once and checked against its
SHA-256. Its CPU tools are built with CMake (Release, this CPU's features: `_cpu_flags`); --cuda
builds the CUDA
backend as well (the GPU machine). The driver beside this file (llama_driver.cpp: prompt and
teacher-forced decode through libllama's public API) is compiled against that build.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

SDIST = "llama_cpp_python-0.3.36.tar.gz"
SDIST_URL = (
    "https://files.pythonhosted.org/packages/ec/e9/"
    "e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/" + SDIST
)
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class LlamaCpp:
    source: Path  # the vendored llama.cpp tree (convert_hf_to_gguf.py, gguf-py)
    build: Path
    quantize: Path
    driver: Path


def default_workdir() -> Path:
    from strata_stream.paths import cache_dir

    return cache_dir() / "peers"


def _fetch(workdir: Path) -> Path:
    archive = workdir / SDIST
    if not archive.exists():
        print(f"fetching {SDIST_URL}", flush=True)
        partial = archive.with_suffix(".partial")
        with urllib.request.urlopen(SDIST_URL, timeout=300) as r, open(partial, "wb") as f:
            shutil.copyfileobj(r, f)
        partial.rename(archive)
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        sys.exit(f"{archive}: SHA-256 {digest}, expected {SDIST_SHA256}: delete it and rerun")
    source = workdir / SDIST.removesuffix(".tar.gz") / "vendor" / "llama.cpp"
    if not (source / "CMakeLists.txt").exists():
        with tarfile.open(archive) as t:
            t.extractall(workdir, filter="data")
    return source


def _cpu_flags() -> list[str]:
    """GGML_NATIVE, except AMX: on a host whose CPU reports AMX but whose hypervisor does not
    let a process use the tile state (this project's x86 VMs), llama.cpp's AMX kernels die of
    SIGILL/SIGSEGV in its default (repacked) path. Where the CPU has AVX-512, the same features
    are named one by one without AMX; elsewhere GGML_NATIVE is used as is."""
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text().split("\n\n")[0] if cpuinfo.exists() else ""
    if " amx_tile" not in flags or " avx512f" not in flags:
        return ["-DGGML_NATIVE=ON"]
    have = {
        f"-DGGML_{name}=ON"
        for name, cpu in [
            ("AVX", "avx"),
            ("AVX2", "avx2"),
            ("FMA", "fma"),
            ("F16C", "f16c"),
            ("BMI2", "bmi2"),
            ("AVX_VNNI", "avx_vnni"),
            ("AVX512", "avx512f"),
            ("AVX512_VBMI", "avx512vbmi"),
            ("AVX512_VNNI", "avx512_vnni"),
            ("AVX512_BF16", "avx512_bf16"),
        ]
        if f" {cpu}" in flags
    }
    return ["-DGGML_NATIVE=OFF", *sorted(have)]


def _run(cmd: list[str], log: Path) -> None:
    print("+", " ".join(cmd), f"(log: {log})", flush=True)
    with open(log, "w") as f:
        if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode != 0:
            sys.exit(f"failed: {' '.join(cmd)}; see {log}")


def build(workdir: Path, cuda: bool = False, jobs: int | None = None) -> LlamaCpp:
    """The pinned llama.cpp built under workdir (once; later calls find it)."""
    workdir.mkdir(parents=True, exist_ok=True)
    source = _fetch(workdir)
    out = workdir / ("llama-build-cuda" if cuda else "llama-build")
    jobs = jobs or os.cpu_count() or 2
    if not (out / "build.ninja").exists():
        _run(
            [
                "cmake",
                "-S",
                str(source),
                "-B",
                str(out),
                "-G",
                "Ninja",
                "-DCMAKE_BUILD_TYPE=Release",
                "-DLLAMA_CURL=OFF",
                "-DLLAMA_BUILD_TESTS=OFF",
                "-DLLAMA_BUILD_SERVER=OFF",
                *_cpu_flags(),
                f"-DGGML_CUDA={'ON' if cuda else 'OFF'}",
            ],
            out.parent / f"{out.name}.cmake.log",
        )
    _run(
        ["cmake", "--build", str(out), "-j", str(jobs), "--target", "llama", "llama-quantize"],
        out.parent / f"{out.name}.build.log",
    )
    driver = out / "llama_driver"
    src = HERE / "llama_driver.cpp"
    if not driver.exists() or driver.stat().st_mtime < src.stat().st_mtime:
        libs = sorted({str(p.parent) for p in out.rglob("lib*.so")})
        _run(
            [
                "c++",
                "-std=c++17",
                "-O2",
                str(src),
                f"-I{source / 'include'}",
                f"-I{source / 'ggml' / 'include'}",
                "-o",
                str(driver),
                *(f"-L{d}" for d in libs),
                *(f"-Wl,-rpath,{d}" for d in libs),
                "-lllama",
                "-lggml",
                "-lggml-base",
            ],
            out.parent / "llama_driver.build.log",
        )
    return LlamaCpp(source, out, out / "bin" / "llama-quantize", driver)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--cuda", action="store_true", help="build the CUDA backend as well")
    p.add_argument("--jobs", type=int, default=None)
    a = p.parse_args()
    print(build(a.workdir or default_workdir(), a.cuda, a.jobs))


if __name__ == "__main__":
    main()
