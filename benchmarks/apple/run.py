"""Everything a Mac user runs to measure the Metal backend, in one command.

    python benchmarks/apple/run.py [--out DIR] [--model mlx-community/Qwen3-30B-A3B-4bit]
                                   [--fractions 0.1 0.25 0.5 1.0] [--dry-run]

Steps, in order (each writes DIR/<step>.json; DIR/summary.json and DIR/summary.png at the end):
  build          cmake with the Metal backend (xcrun metal + metallib), _core and the metallib
                 copied into src/strata_stream
  parity         every pack format through Window(backend="metal") against the CPU backend and
                 the numpy oracle, and I11 (25% arena == all-resident, bit for bit)
  window_metal   kernel GB/s (all resident), handshake us/layer, decode and prompt tokens/s at
  window_cpu     each arena fraction - Metal and CPU side by side on the same preset pack
  io             engine read GB/s against a raw F_NOCACHE reader
  mlx_baseline   plain mlx-lm on --model: prompt and decode tokens/s
  model_streamed the same model streamed through strata-stream at each arena, on MLX's
                 kernels over the arena and on this Metal backend

--dry-run (any OS) checks the plan without running it: every script exists and accepts every
flag the plan passes it, and each step's requirements are evaluated and reported; it writes
DIR/plan.json and exits 0 when the plan is sound. Without --dry-run, a machine that is not
macOS on Apple silicon is refused.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
BUILD = ROOT / "build" / "apple"


@dataclass
class Requirement:
    what: str
    missing: Callable[[], str | None]  # None when met, else why not


@dataclass
class Step:
    name: str
    commands: list[list[str]]
    needs: list[Requirement] = field(default_factory=list)
    blocked: str | None = None  # a known gap: reported, never run


def _is_apple_silicon() -> str | None:
    if sys.platform != "darwin" or platform.machine() != "arm64":
        return f"this is {sys.platform}/{platform.machine()}, not macOS on Apple silicon"
    return None


def _tool(name: str) -> Requirement:
    return Requirement(name, lambda: None if shutil.which(name) else f"{name} not on PATH")


def _module(name: str) -> Requirement:
    def missing() -> str | None:
        import importlib.util

        return None if importlib.util.find_spec(name) else f"python module {name} not installed"

    return Requirement(f"python module {name}", missing)


APPLE = Requirement("macOS on Apple silicon", _is_apple_silicon)


def plan(out: Path, model: str, fractions: list[float]) -> list[Step]:
    py = sys.executable
    fr = [f"{f:g}" for f in fractions]
    pybind = "import pybind11, sys; sys.stdout.write(pybind11.get_cmake_dir())"
    install = (
        "import glob, shutil; "
        f"[shutil.copy(f, r'{ROOT / 'src' / 'strata_stream'}') for f in "
        f"glob.glob(r'{BUILD}/_core*.so') + glob.glob(r'{BUILD}/_bench*.so') + "
        f"glob.glob(r'{BUILD}/strata_kernels.metallib')]"
    )
    return [
        Step(
            "build",
            [
                [
                    "cmake",
                    "-S",
                    str(ROOT),
                    "-B",
                    str(BUILD),
                    "-G",
                    "Ninja",
                    "-DCMAKE_BUILD_TYPE=Release",
                    "-DSTRATA_BUILD_PYTHON=ON",
                    f"-DPython_EXECUTABLE={py}",
                    f"-Dpybind11_DIR=$({py} -c '{pybind}')",
                ],
                ["cmake", "--build", str(BUILD)],
                [py, "-c", install],
            ],
            [APPLE, _tool("xcrun"), _tool("cmake"), _tool("ninja"), _module("pybind11")],
        ),
        Step(
            "parity",
            [
                [
                    py,
                    str(HERE / "parity.py"),
                    "--backend",
                    "metal",
                    "--reference",
                    "cpu",
                    "--json",
                    str(out / "parity.json"),
                ]
            ],
            [APPLE],
        ),
        Step(
            "window_metal",
            [
                [
                    py,
                    str(HERE / "window_bench.py"),
                    "--backend",
                    "metal",
                    "--fractions",
                    *fr,
                    "--json",
                    str(out / "window_metal.json"),
                ]
            ],
            [APPLE],
        ),
        Step(
            "window_cpu",
            [
                [
                    py,
                    str(HERE / "window_bench.py"),
                    "--backend",
                    "cpu",
                    "--fractions",
                    *fr,
                    "--json",
                    str(out / "window_cpu.json"),
                ]
            ],
            [APPLE],
        ),
        Step("io", [[py, str(HERE / "io_nocache.py"), "--json", str(out / "io.json")]], [APPLE]),
        Step(
            "mlx_baseline",
            [
                [
                    py,
                    str(HERE / "mlx_baseline.py"),
                    "--model",
                    model,
                    "--json",
                    str(out / "mlx_baseline.json"),
                ]
            ],
            [APPLE, _module("mlx_lm")],
        ),
        Step(
            "model_streamed",
            [
                [
                    py,
                    str(HERE / "mlx_streamed.py"),
                    "--model",
                    model,
                    "--fractions",
                    *fr,
                    "--experts",
                    "mlx",
                    "metal",
                    "--json",
                    str(out / "model_streamed.json"),
                ]
            ],
            [APPLE, _module("mlx_lm")],
        ),
    ]


def check_flags(command: list[str]) -> list[str]:
    """Problems with a `python script.py --flags` command: the script exists and its --help
    lists every flag the plan passes."""
    if len(command) < 2 or not command[1].endswith(".py"):
        return []
    script = Path(command[1])
    if not script.exists():
        return [f"{script} does not exist"]
    helptext = subprocess.run(
        [command[0], str(script), "--help"], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    if helptext.returncode != 0:
        return [f"{script.name} --help failed: {helptext.stderr.strip()[-300:]}"]
    return [
        f"{script.name} does not accept {flag}"
        for flag in command[2:]
        if flag.startswith("--") and flag not in helptext.stdout
    ]


def summarise(out: Path) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for f in sorted(out.glob("*.json")):
        if f.name not in ("summary.json", "plan.json"):
            summary[f.stem] = json.loads(f.read_text())
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for backend in ("metal", "cpu"):
        rows = summary.get(f"window_{backend}", {}).get("arenas", [])
        if rows:
            ax.plot(
                [100 * r["fraction"] for r in rows],
                [r["decode_tokens_per_s"]["median"] for r in rows],
                "o-",
                label=f"strata-stream, {backend} (synthetic qwen3-30b-a3b)",
            )
    base = summary.get("mlx_baseline")
    if base:
        ax.axhline(
            base["decode_tokens_per_s"]["median"],
            color="gray",
            ls="--",
            label=f"plain mlx-lm, {base['model']}",
        )
    ax.set_xlabel("arena, % of all experts")
    ax.set_ylabel("decode tokens/s")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "summary.png", dpi=120)
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "apple")
    ap.add_argument("--model", default="mlx-community/Qwen3-30B-A3B-4bit")
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.10, 0.25, 0.50, 1.00])
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    steps = plan(args.out, args.model, args.fractions)

    if args.dry_run:
        problems: list[str] = []
        report = []
        for s in steps:
            unmet = {r.what: why for r in s.needs if (why := r.missing()) is not None}
            for c in s.commands:
                problems += [f"{s.name}: {p}" for p in check_flags(c)]
            report.append(
                {"step": s.name, "commands": s.commands, "unmet": unmet, "blocked": s.blocked}
            )
            state = (
                "blocked: " + s.blocked
                if s.blocked
                else ("ready" if not unmet else "needs " + "; ".join(unmet.values()))
            )
            print(f"{s.name:>15}  {state}")
        (args.out / "plan.json").write_text(
            json.dumps({"steps": report, "problems": problems}, indent=2)
        )
        for p in problems:
            print("plan problem:", p)
        return 1 if problems else 0

    if (why := _is_apple_silicon()) is not None:
        print(
            f"refusing to run: {why}. This measures the Metal backend; use --dry-run to check "
            "the plan here.",
            file=sys.stderr,
        )
        return 2
    failed = []
    for s in steps:
        if s.blocked:
            print(f"== {s.name}: skipped, {s.blocked}")
            continue
        unmet = [why for r in s.needs if (why := r.missing()) is not None]
        if unmet:
            print(f"== {s.name}: skipped, {'; '.join(unmet)}")
            failed.append(s.name)
            continue
        print(f"== {s.name}")
        for c in s.commands:
            r = subprocess.run(
                " ".join(c) if any("$(" in a for a in c) else c,
                shell=any("$(" in a for a in c),
                cwd=ROOT,
            )
            if r.returncode != 0:
                failed.append(s.name)
                break
    summarise(args.out)
    print(
        f"results in {args.out}/summary.json and summary.png"
        + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
