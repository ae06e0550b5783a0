"""strata_stream._bench, the C++ halves of the kernel and raw-read benchmarks, built on demand.

An install of strata-stream does not build it (the product carries no benchmark code). The
benchmarks that need it (cpu_kernels.py, io_bandwidth.py, io_path.py) call `load()`: it imports
the module where a development build made it (`pip install -e .
-Ccmake.define.STRATA_BUILD_BENCH=ON`, or tests/cuda/device_run.sh), and otherwise configures
this checkout with CMake once, builds the target `_bench` into the cache
(`<cache>/bench-build`, STRATA_CACHE) and imports it from there. The first build takes minutes;
later calls rebuild only what changed.

    python benchmarks/bench_ext.py    # builds it now and prints where it is
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def build_dir() -> Path:
    from strata_stream.paths import cache_dir

    return cache_dir() / "bench-build"


def build() -> Path:
    """Configures (once) and builds the target _bench; returns the built module's path."""
    import pybind11

    out = build_dir()
    if not (out / "CMakeCache.txt").exists():
        subprocess.run(
            [
                "cmake", "-S", str(ROOT), "-B", str(out), "-DCMAKE_BUILD_TYPE=Release",
                "-DSTRATA_BUILD_PYTHON=ON", "-DSTRATA_CUDA=OFF",
                f"-DPython_EXECUTABLE={sys.executable}",
                f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            ],
            check=True,
        )  # fmt: skip
    jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 1))
    subprocess.run(["cmake", "--build", str(out), "--target", "_bench", "-j", jobs], check=True)
    found = sorted(out.glob("_bench*.so")) + sorted(out.glob("_bench*.pyd"))
    if not found:
        raise RuntimeError(f"the _bench build in {out} made no module")
    return found[0]


def load() -> ModuleType:
    """strata_stream._bench: the installed one, else one built on demand (`build()`)."""
    try:
        from strata_stream import _bench

        return _bench
    except ImportError:
        pass
    path = build()
    spec = importlib.util.spec_from_file_location("strata_stream._bench", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["strata_stream._bench"] = module
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    print(load().__file__)
