"""The transformers coverage matrix (tests/model_coverage/transformers_matrix.py) as tests, one per
model type, each in its own subprocess.

By default a fixed sample: one model type per seam (plain top-k softmax routers, gpt-oss's
transposed experts with biases and clamped SwiGLU, DeepSeek-style group-limited sigmoid routing
with shared experts, per-expert checkpoints' families, hybrid linear attention, multimodal
configs whose causal LM is the text model, the causal-LM class found beyond
AutoModelForCausalLM's table, and experts the pack cannot hold). ``STRATA_MATRIX=all`` runs
every experts-interface type the installed transformers ships.

A row passes when it streams exactly, or is refused or skipped with its one-line reason; a
mismatch (wrong output) or a crash (a traceback instead of a clear error) fails. The sample's
streamable seams must stream exactly.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
# The matrix runs as `python -m tests.model_coverage.transformers_matrix` from the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.model_coverage.transformers_matrix import candidates, run_type  # noqa: E402

# The seams the sample must stream exactly, and one the pack cannot hold (refused by name).
EXACT = ["qwen3_moe", "gpt_oss", "deepseek_v3", "mixtral", "qwen3_next", "qwen3_5_moe", "mistral4"]
REFUSED = ["nemotron_h"]
TYPES = candidates() if os.environ.get("STRATA_MATRIX") == "all" else EXACT + REFUSED


@pytest.mark.parametrize("model_type", TYPES)
def test_model_type_streams_exactly_or_says_why(model_type: str) -> None:
    row = run_type(model_type, timeout=600)
    print(f"{model_type}: {row.result}")
    if model_type in EXACT:
        assert row.exact, row.result
    elif model_type in REFUSED:
        assert row.result.startswith(f"refused: {model_type}: "), row.result
    else:
        assert row.exact or row.result.startswith(("refused: ", "skip: ")), row.result
    assert "\n" not in row.result
