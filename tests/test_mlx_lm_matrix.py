"""The mlx-lm coverage matrix as tests: every MoE model type of the installed mlx-lm streams
bitwise like plain mlx-lm on both expert paths, or is skipped with the reason it cannot run
tiny in plain mlx-lm itself (tests/coverage/mlx_lm_matrix.py builds and compares; each type in
its own subprocess).

STRATA_MATRIX=sample (the default) runs SAMPLE, one type per distinct seam, so every run
keeps a fast path through each; STRATA_MATRIX=all runs every MoE type discovery finds (a new
family of an upgraded mlx-lm is a new test, not a silent gap).
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:  # `tests.coverage` is imported from the repository root
    sys.path.insert(0, _ROOT)

from tests.coverage import mlx_lm_matrix as matrix  # noqa: E402

# One model type per seam the front-end must serve: SwitchGLU behind a softmax gate
# (qwen3_moe), top-k-then-softmax (mixtral), a DeepSeek-style grouped sigmoid gate with shared
# experts and a dense first layer (deepseek_v3), expert biases and the clamped SwiGLU
# (gpt_oss), a shared expert behind a gate in a linear-attention hybrid (qwen3_next),
# SwitchMLP with a non-gated activation (phixtral), and a text model inside a multimodal
# wrapper (qwen3_vl_moe).
SAMPLE = (
    "qwen3_moe",
    "mixtral",
    "deepseek_v3",
    "gpt_oss",
    "qwen3_next",
    "phixtral",
    "qwen3_vl_moe",
)
MODE = os.environ.get("STRATA_MATRIX", "sample")
if MODE not in ("sample", "all"):
    raise pytest.UsageError(f"STRATA_MATRIX must be sample or all, got {MODE!r}")


@functools.cache
def discovered() -> dict[str, matrix.Found]:
    return {f.model_type: f for f in matrix.discover()}


def _types() -> list[str]:
    return sorted(discovered()) if MODE == "all" else list(SAMPLE)


@pytest.mark.parametrize("model_type", _types())
def test_streams_bitwise_plain_mlx_lm(model_type: str) -> None:
    found = discovered().get(model_type)
    if found is None:
        version, _ = matrix.versions()
        pytest.skip(f"{model_type} is not a MoE model type of mlx-lm {version}")
    row = matrix.run_type(found, timeout=600.0)
    failures = row.failures
    assert not failures, f"{model_type}: " + "; ".join(failures)
    if not row.exact:
        pytest.skip(f"{model_type}: " + "; ".join(row.skips))
