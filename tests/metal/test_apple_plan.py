"""benchmarks/apple/: the Mac measurement plan is sound (dry run), and its parity script works
(run here with the CPU backend on both sides, which checks the script, not Metal)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
APPLE = ROOT / "benchmarks" / "apple"


def test_dry_run_checks_the_plan(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, str(APPLE / "run.py"), "--dry-run", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["problems"] == []
    steps = {s["step"]: s for s in plan["steps"]}
    assert list(steps) == [
        "build",
        "parity",
        "window_metal",
        "window_cpu",
        "io",
        "mlx_baseline",
        "model_streamed",
    ]
    # The streamed model runs on both expert paths, every flag checked against its --help.
    streamed = steps["model_streamed"]
    assert not streamed["blocked"]
    assert any("mlx_streamed.py" in part for part in streamed["commands"][0])
    assert streamed["commands"][0][-5:-2] == ["--experts", "mlx", "metal"]
    if sys.platform != "darwin":
        assert "macOS on Apple silicon" in steps["parity"]["unmet"]


def test_run_without_dry_run_refuses_off_apple_silicon(tmp_path: Path) -> None:
    if sys.platform == "darwin":
        return
    r = subprocess.run(
        [sys.executable, str(APPLE / "run.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert r.returncode == 2 and "not macOS on Apple silicon" in r.stderr


def test_parity_script_runs_with_the_cpu_backend(tmp_path: Path) -> None:
    out = tmp_path / "parity.json"
    r = subprocess.run(
        [
            sys.executable,
            str(APPLE / "parity.py"),
            "--backend",
            "cpu",
            "--formats",
            "q4_g64_sbf16",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads(out.read_text())
    assert result["ok"] and [f["format"] for f in result["formats"]] == ["q4_g64_sbf16"]
    assert result["formats"][0]["vs_oracle"] < 1e-3
