"""The transformers coverage matrix (tests/model_coverage/transformers_matrix.py) as tests, one per
model type, each in its own subprocess.

By default a fixed sample: one model type per seam (plain top-k softmax routers, gpt-oss's
transposed experts with biases and clamped SwiGLU, DeepSeek-style group-limited sigmoid routing
with shared experts, per-expert checkpoints' families, hybrid linear attention, multimodal
configs whose causal LM is the text model, the causal-LM class found beyond
AutoModelForCausalLM's table, a vision model generating through its image-text-to-text class,
its text sub-config, which has no generation class and streams as its AutoModel, the
activations of pack format version 4 and its gateless experts, and experts the pack cannot
hold).
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

from tests.model_coverage.transformers_matrix import candidates, run_type  # noqa: E402

# The seams the sample must stream exactly, and two types with no generation class (load's
# model_class=): a text sub-config built as AutoModel (its last hidden state is compared) and
# the privacy filter's token classifier, the one head transformers maps for it, whose experts
# split gate and up into concatenated halves of gpt-oss's fused layout (its logits are
# compared). Neither has greedy tokens.
EXACT = ["qwen3_moe", "gpt_oss", "deepseek_v3", "mixtral", "qwen3_next", "qwen3_5_moe", "mistral4",
         "qwen3_vl_moe",
         # pack format version 4: gateless experts (relu2), SwiGLU between clamps, GELU-tanh
         # GLU, softcapped SwiGLU
         "nemotron_h", "hy_v4", "gemma4_text", "inkling2_text",
         # a forward of the experts class's own around the dispatch (a norm after each expert)
         "ergo"]  # fmt: skip
NO_GENERATION = {
    "qwen3_vl_moe_text": "AutoModel's Qwen3VLMoeTextModel last_hidden_state",
    "openai_privacy_filter": (
        "AutoModelForTokenClassification's OpenAIPrivacyFilterForTokenClassification logits"
    ),
}
TYPES = candidates() if os.environ.get("STRATA_MATRIX") == "all" else [*EXACT, *NO_GENERATION]


@pytest.mark.parametrize("model_type", TYPES)
def test_model_type_streams_exactly_or_says_why(model_type: str) -> None:
    row = run_type(model_type, timeout=600)
    print(f"{model_type}: {row.result}")
    if model_type in EXACT:
        assert row.exact, row.result
    elif model_type in NO_GENERATION:
        assert row.exact, row.result
        assert row.result.startswith("exact (no generation class: "), row.result
        assert NO_GENERATION[model_type] in row.result and "no greedy tokens" in row.result
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


def test_a_type_without_a_generation_class_is_built_as_the_class_transformers_maps() -> None:
    """The task head transformers maps where there is exactly one (the privacy filter's token
    classification), else AutoModel (a text sub-config's text model); a generation class is
    not consulted here (qwen3_moe has several heads: AutoModel)."""
    import transformers
    from tests.model_coverage.transformers_matrix import output_class
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    def auto(model_type: str) -> Any:
        return output_class(CONFIG_MAPPING[model_type])

    assert auto("openai_privacy_filter") is transformers.AutoModelForTokenClassification
    assert auto("qwen3_vl_moe_text") is transformers.AutoModel
    assert auto("qwen3_moe") is transformers.AutoModel


def test_a_row_counts_as_streaming_exactly_when_its_comparisons_pass() -> None:
    from tests.model_coverage.transformers_matrix import Row, closing_line

    rows = [
        Row("a", "exact"),
        Row(
            "a_text",
            "exact (no generation class: AutoModel's ATextModel last_hidden_state "
            "teacher-forced, no greedy tokens)",
        ),
        Row("b_text", "refused: b_text: experts module BExperts applies a norm after each expert"),
        Row("c", "mismatch (logits: max|diff| 0.1 of max|logits| 3)"),
        Row("d", "skip: plain transformers fails to run tiny (TypeError: no)"),
    ]
    assert [r.exact for r in rows] == [True, True, False, False, False]
    line = closing_line(rows)
    assert ": 2 of 5 MoE model types stream exactly (2 of the 4 that build and run tiny" in line
    assert "1 of them have no generation class" in line
