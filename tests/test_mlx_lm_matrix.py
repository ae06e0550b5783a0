"""The mlx-lm coverage matrix as tests: every MoE model type of the installed mlx-lm streams
bitwise like plain mlx-lm on both expert paths, or is skipped with the reason it cannot run
tiny in plain mlx-lm itself (tests/model_coverage/mlx_lm_matrix.py builds and compares; each type in
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
if _ROOT not in sys.path:  # `tests.model_coverage` is imported from the repository root
    sys.path.insert(0, _ROOT)

from tests.model_coverage import mlx_lm_matrix as matrix  # noqa: E402

# One model type per seam the front-end must serve: SwitchGLU behind a softmax gate
# (qwen3_moe), top-k-then-softmax (mixtral), a DeepSeek-style grouped sigmoid gate with shared
# experts and a dense first layer (deepseek_v3), expert biases and the clamped SwiGLU
# (gpt_oss), a shared expert behind a gate in a linear-attention hybrid (qwen3_next),
# SwitchMLP with a non-gated activation (phixtral), a text model inside a multimodal
# wrapper (qwen3_vl_moe), experts in a module of their own with a GELU-gated SwitchGLU
# (gemma4_text), and formats that differ by projection, from the model's own quant predicate
# (granitemoe: 8-bit down projections).
SAMPLE = (
    "qwen3_moe",
    "mixtral",
    "deepseek_v3",
    "gpt_oss",
    "qwen3_next",
    "phixtral",
    "qwen3_vl_moe",
    "gemma4_text",
    "granitemoe",
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


# The matrix's own logic, on made-up results (no model is built).


def test_compare_names_the_largest_difference_and_the_first_other_token() -> None:
    import numpy as np

    logits = np.zeros((3, 4), np.float32)
    other = logits.copy()
    other[1, 2] = 0.5
    assert matrix._compare((logits, [1, 2, 3]), (logits.copy(), [1, 2, 3])) == "exact"
    assert matrix._compare((logits, [1, 2, 3]), (other, [1, 2, 3])) == (
        "mismatch (max |diff| 0.5, tokens equal)"
    )
    assert matrix._compare((logits, [1, 2, 3]), (logits, [1, 5, 3])) == (
        "mismatch (max |diff| 0, first differing token 1)"
    )
    nan = np.full((3, 4), np.nan, np.float32)
    assert matrix._compare((nan, [1]), (nan.copy(), [1])) == "exact"


def test_the_float32_cpu_cell_counts_within_its_tolerance_with_the_same_tokens() -> None:
    import numpy as np

    ref = np.full((2, 3), 10.0, np.float32)
    near = ref.copy()
    near[0, 0] += 5e-5  # 5e-6 of the largest logit
    far = ref.copy()
    far[0, 0] += 5e-3
    rtol = matrix.F32_CPU_RTOL
    assert matrix._compare((ref, [1]), (near, [1]), rtol).startswith("exact (float32 order")
    assert matrix._compare((ref, [1]), (near, [1])).startswith("mismatch")  # bitwise elsewhere
    assert matrix._compare((ref, [1]), (far, [1]), rtol).startswith("mismatch")
    assert matrix._compare((ref, [1]), (near, [2]), rtol).startswith("mismatch")
    cells = {v: dict.fromkeys(matrix.PATHS, "exact") for v in matrix.VARIANTS}
    cells["f32"]["cpu"] = "exact (float32 order, max |diff| 5e-05 of 10)"
    row = matrix.Row("a", cells)
    assert row.exact and row.failures == [] and row.summary == "exact"


def test_a_row_counts_only_when_every_cell_is_exact() -> None:
    exact = {v: dict.fromkeys(matrix.PATHS, "exact") for v in matrix.VARIANTS}
    one_off = {v: dict(c) for v, c in exact.items()}
    one_off["f32"]["cpu"] = "mismatch (max |diff| 1e-06, tokens equal)"
    skipped = {v: dict.fromkeys(matrix.PATHS, "skip: plain mlx-lm fails") for v in exact}
    rows = [matrix.Row("a", exact), matrix.Row("b", one_off), matrix.Row("c", skipped)]
    assert [r.exact for r in rows] == [True, False, False]
    assert rows[1].failures == ["f32/cpu: mismatch (max |diff| 1e-06, tokens equal)"]
    assert rows[1].summary == "f32/cpu: mismatch (max |diff| 1e-06, tokens equal)"
    assert rows[2].failures == [] and len(rows[2].skips) == 4
    assert matrix.closing_line(rows, "9.9.9") == (
        "mlx-lm 9.9.9: 1 of 3 MoE model types stream exactly"
    )


def test_write_docs_replaces_only_its_region(tmp_path: Path) -> None:
    doc = tmp_path / "models.md"
    other = "<!-- matrix:transformers -->\nkept\n<!-- /matrix:transformers -->\n"
    doc.write_text(f"# T\n\n{matrix.BEGIN}\nold\n{matrix.END}\n\n{other}")
    matrix.write_docs(doc, "new table")
    assert doc.read_text() == f"# T\n\n{matrix.BEGIN}\nnew table\n{matrix.END}\n\n{other}"
    doc.write_text("# no markers\n")
    with pytest.raises(SystemExit, match="needs one"):
        matrix.write_docs(doc, "x")


def test_a_refusal_is_a_skip_only_where_it_names_a_limit_of_the_design() -> None:
    from strata_stream.errors import ConfigError

    limit = ConfigError("phixtral's routed experts have one input projection and no gate (x)")
    assert matrix._failure(limit).startswith("skip: the pack cannot hold them: ")
    assert matrix._failure(ConfigError("no routed expert tensors found")).startswith("refused: ")
    assert matrix._failure(RuntimeError("boom")) == "crash: RuntimeError: boom"
