"""The tests' planted kernel errors (STRATA_CUDA_TEST_PLANT) are compiled only into the CUDA tests'
build: every kernel line that reads a plant bit sits inside `#if STRATA_CUDA_PLANT`, which the
release build leaves 0 (csrc/cuda/kernels/device_types.h). Reads the sources: no GPU needed."""

from __future__ import annotations

import re
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[2] / "csrc" / "cuda" / "kernels"
PLANT_READ = re.compile(r"\bkPlant(GateUp|Route)\b")


def unguarded_plant_reads(text: str) -> list[int]:
    """Line numbers that read a plant bit outside an `#if STRATA_CUDA_PLANT` block."""
    out: list[int] = []
    stack: list[bool] = []  # per open #if: whether it is the plant's guard
    for number, line in enumerate(text.splitlines(), 1):
        directive = line.strip()
        if directive.startswith(("#if", "#ifdef", "#ifndef")):
            stack.append(directive.split("//")[0].split() == ["#if", "STRATA_CUDA_PLANT"])
        elif directive.startswith("#endif") and stack:
            stack.pop()
        elif directive.startswith("#el") and stack:
            stack[-1] = False
        elif PLANT_READ.search(line) and "constexpr" not in line and not any(stack):
            out.append(number)
    return out


def test_release_kernels_carry_no_planted_branch() -> None:
    sources = sorted(KERNELS.glob("*.cu")) + sorted(KERNELS.glob("*.cuh"))
    reads = {p.name: unguarded_plant_reads(p.read_text()) for p in sources}
    assert {name: lines for name, lines in reads.items() if lines} == {}
    # Every planted error is still there for the tests' build, behind the guard.
    guarded = sum(len(PLANT_READ.findall(p.read_text())) for p in sources)
    assert guarded >= 4  # gate_up in three kernel families, and the route


def test_the_guard_check_finds_an_unguarded_read() -> None:
    line = "  if ((L.plant & kPlantGateUp) && r == 0) h += 1.0f / 1024.0f;"
    assert unguarded_plant_reads(f"x\n{line}\n") == [2]
    assert unguarded_plant_reads(f"#if STRATA_CUDA_PLANT  // tests only\n{line}\n#endif\n") == []
    assert unguarded_plant_reads(f"#if STRATA_CUDA_PLANT\n#else\n{line}\n#endif\n") == [3]
