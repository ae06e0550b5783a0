"""The Metal host's dispatch plan on its edges (tests/metal/dispatch_plan_check.cpp): arena
views, the configurations it refuses by name (moce, group 256, top_k past 32, too many views),
gpt-oss's activation and expert biases handed to their kernels, and the grids it plans."""

from __future__ import annotations

import subprocess
from pathlib import Path

from shim_build import METAL, build_program

HERE = Path(__file__).resolve().parent


def test_dispatch_plan_edges() -> None:
    exe = build_program(
        "dispatch_plan_check",
        [HERE / "dispatch_plan_check.cpp", METAL / "host" / "dispatch_plan.cpp"],
        ["-fsanitize=address,undefined", "-g"],
    )
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "FAIL" not in r.stdout and r.stdout.count("ok ") == 14
