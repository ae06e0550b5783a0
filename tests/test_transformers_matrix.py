"""The transformers coverage matrix (tests/model_coverage/transformers_matrix.py) as tests, one per
model type, each in its own subprocess.

By default a fixed sample: one model type per seam (plain top-k softmax routers, gpt-oss's
transposed experts with biases and clamped SwiGLU, DeepSeek-style group-limited sigmoid routing
with shared experts, per-expert checkpoints' families, hybrid linear attention, multimodal
configs whose causal LM is the text model, the causal-LM class found beyond
AutoModelForCausalLM's table, a vision model generating through its image-text-to-text class,
its text sub-config covered by that row, the activations of pack format version 4 and its
gateless experts, and experts the pack cannot hold).
``STRATA_MATRIX=all`` runs every experts-interface type the installed transformers ships.

The tiny-config builder's rules (shrink from the library's defaults, keep their relations,
meet a validator's demand) are tested on a config class of known defaults.

A row passes when it streams exactly, or is refused or skipped with its one-line reason; a
mismatch (wrong output) or a crash (a traceback instead of a clear error) fails. The sample's
streamable seams must stream exactly.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
# The matrix runs as `python -m tests.model_coverage.transformers_matrix` from the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.model_coverage.transformers_matrix import SUB_CONFIG, candidates, run_type  # noqa: E402

# The seams the sample must stream exactly, one the pack cannot hold (refused by name), and a
# text sub-config with no generation class of its own (its parent, in EXACT, covers it).
EXACT = ["qwen3_moe", "gpt_oss", "deepseek_v3", "mixtral", "qwen3_next", "qwen3_5_moe", "mistral4",
         "qwen3_vl_moe",
         # pack format version 4: gateless experts (relu2), SwiGLU between clamps, GELU-tanh
         # GLU, softcapped SwiGLU
         "nemotron_h", "hy_v4", "gemma4_text", "inkling2_text"]  # fmt: skip
REFUSED = ["ergo"]
SUB_CONFIGS = {"qwen3_vl_moe_text": "qwen3_vl_moe"}
TYPES = (
    candidates() if os.environ.get("STRATA_MATRIX") == "all" else [*EXACT, *REFUSED, *SUB_CONFIGS]
)


@pytest.mark.parametrize("model_type", TYPES)
def test_model_type_streams_exactly_or_says_why(model_type: str) -> None:
    row = run_type(model_type, timeout=600)
    print(f"{model_type}: {row.result}")
    if model_type in EXACT:
        assert row.exact, row.result
    elif model_type in REFUSED:
        assert row.result.startswith(f"refused: {model_type}: "), row.result
    elif model_type in SUB_CONFIGS:
        assert row.result == f"skip: {SUB_CONFIG.format(parent=SUB_CONFIGS[model_type])}"
    else:
        assert row.exact or row.result.startswith(("refused: ", "skip: ")), row.result
    assert "\n" not in row.result


class _Defaults:
    """A config class as the tiny builder reads one: defaults from ``to_dict()`` of an instance
    made with no arguments (the numbers of a large model's release)."""

    model_type = "fake_moe"
    attribute_map = {"n_group": "num_expert_group"}
    DEFAULTS: dict[str, Any] = {
        "hidden_size": 4096,
        "adapter_in_dim": 4096,  # a projector's input: must equal hidden_size
        "num_experts_per_tok": 1,  # a library that supports top-1 only
        "n_shared_experts": 0,  # 0: none
        "num_expert_group": 8,  # TINY's n_group, under the config's own name
        "num_attention_heads": 64,
        "num_key_value_heads": 4,
        "index_num_heads": 12,
        "vocab_size": 201024,
        "unpadded_vocab_size": 200058,  # at most vocab_size
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "head_dim": 64,  # the rotary part, as the model reads it
        "rope_parameters": {"rope_type": "default", "mrope_section": [12, 10, 10]},
    }

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = {**self.DEFAULTS, **kwargs}

    def to_dict(self) -> dict[str, Any]:
        return dict(self.kwargs)


def test_the_tiny_config_shrinks_the_defaults_and_keeps_their_relations() -> None:
    from tests.model_coverage.transformers_matrix import HIDDEN, TINY, _tiny

    t = _tiny(_Defaults)
    assert t["hidden_size"] == t["adapter_in_dim"] == HIDDEN
    assert t["num_experts_per_tok"] == 1  # shrunk, never grown
    assert "n_shared_experts" not in t  # its default, 0, stands
    assert t["num_expert_group"] == TINY["n_group"]
    # the query : key-value ratio (16) kept as far as one key-value head allows
    assert (t["num_attention_heads"], t["num_key_value_heads"]) == (2, 1)
    assert t["index_num_heads"] <= t["num_attention_heads"]
    assert t["unpadded_vocab_size"] <= t["vocab_size"] == TINY["vocab_size"]
    assert t["head_dim"] == t["qk_rope_head_dim"] == TINY["qk_rope_head_dim"]
    sections = t["rope_parameters"]["mrope_section"]
    # the defaults' sections are half the rotary width; height and width stay equal
    assert sum(sections) == t["qk_rope_head_dim"] // 2 and sections[1] == sections[2]
    assert _Defaults.DEFAULTS["rope_parameters"]["mrope_section"] == [12, 10, 10]


def test_a_validator_demand_that_names_its_value_is_met() -> None:
    from tests.model_coverage.transformers_matrix import _demand

    kwargs: dict[str, Any] = {"hidden_size": 64, "adapter_in_dim": 4096}
    assert _demand("ValueError: adapter_in_dim must match hidden_size", kwargs, _Defaults)
    assert kwargs["adapter_in_dim"] == 64
    msg = "`vision_config.text_hidden_size` (2304) must match `text_config.hidden_size` (64)."
    assert _demand(msg, kwargs, _Defaults)
    assert kwargs["vision_config"] == {"text_hidden_size": 64}
    assert _demand("`index_num_heads` must be between 1 and the heads of one", kwargs, _Defaults)
    assert kwargs["index_num_heads"] == 1
    # met already, or nothing generic to read: the error stands
    assert not _demand("ValueError: adapter_in_dim must match hidden_size", kwargs, _Defaults)
    assert not _demand("ZAYA currently supports `num_experts_per_tok=1` only.", kwargs, _Defaults)


def test_a_text_sub_config_is_covered_only_by_a_parent_that_streams() -> None:
    from tests.model_coverage.transformers_matrix import SUB_CONFIG, Row, settle

    covered = f"skip: {SUB_CONFIG.format(parent='vl_a')}"
    rows = [
        Row("vl_a", "exact"),
        Row("vl_a_text", covered),
        Row("vl_b", "refused: vl_b: no"),
        Row("vl_b_text", f"skip: {SUB_CONFIG.format(parent='vl_b')}"),
    ]
    got = {r.model_type: r.result for r in settle(rows)}
    assert got["vl_a_text"] == covered
    assert got["vl_b_text"].startswith("skip: ")
    assert "(vl_b) does not stream exactly" in got["vl_b_text"]
