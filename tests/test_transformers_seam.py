"""The transformers front-end by the seam (strata_stream.transformers.families): blocks are taken
on by their experts module's structure, never by class name, and prediction is found by
structure and can only ever cost IO.

- a block whose experts compute another activation than the pack's is refused by name, never
  computed with the wrong one;
- experts the pack cannot hold (no gate projection) are one line naming the model type;
- the causal-LM class is found as transformers finds it, beyond AutoModelForCausalLM's table,
  and a vision model's generation class likewise (AutoModelForImageTextToText's);
- a corrupted predictor (wrong ids) and no predictor at all (the profile stands in, as the
  engine's stats say) give bitwise the output of the real one.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from strata_stream.errors import ConfigError  # noqa: E402
from strata_stream.transformers import describe, load  # noqa: E402
from strata_stream.transformers import engine as engine_module  # noqa: E402
from strata_stream.transformers.experts import StreamedExperts  # noqa: E402
from strata_stream.transformers.families import (  # noqa: E402
    Router,
    family_of,
    find_blocks,
    find_router,
    is_experts_module,
)
from strata_stream.transformers.loader import causal_lm_class  # noqa: E402
from strata_stream.transformers.random_model import make_checkpoint  # noqa: E402
from test_transformers_families import BASE, Family, generate, logits  # noqa: E402


@pytest.fixture(scope="module", params=["qwen3_moe", "gpt_oss", "deepseek_v3"])
def fam(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Family:
    return Family(request.param, tmp_path_factory.mktemp("seam"), "float32")


def test_blocks_are_found_by_the_experts_interface_not_by_name(fam: Family) -> None:
    model = fam.ref
    blocks = find_blocks(model)
    assert blocks and all(attr == "experts" for _, _, attr in blocks)
    for _, block, attr in blocks:
        experts = getattr(block, attr)
        assert is_experts_module(experts)
        f = family_of(experts, model.config.model_type)
        e, a, b = experts.gate_up_proj.shape
        # gpt-oss's [E, H, 2I] and the others' [E, 2I, H], told apart by the hidden axis
        assert f.transposed == (a == model.config.hidden_size)
        assert (f.n_experts, f.hidden) == (e, model.config.hidden_size)
        assert f.has_bias == (fam.name == "gpt_oss")
    # A module of the same structure under any class name is taken on alike.
    _, block, _ = blocks[0]
    renamed = type("SomethingElse", (type(block.experts),), {})
    block.experts.__class__ = renamed
    try:
        assert is_experts_module(block.experts)
    finally:
        block.experts.__class__ = renamed.__mro__[1]
    assert not is_experts_module(block)  # the block itself is not an experts module


def test_every_layer_predicts_with_its_router(fam: Family, closing: list[Any]) -> None:
    model = fam.load(2 * fam.top_k)
    closing.append(model)
    stats = describe(model)
    n = len(model.strata_engine.blocks)
    assert stats["prediction"] == ["router"] * n and stats["prediction_profile_layers"] == 0


def test_a_corrupted_predictor_costs_io_never_output(
    fam: Family, closing: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Wrong ids from every next-layer router: the reads go astray, the output stays bitwise."""
    k = fam.top_k
    clean = fam.load(2 * k)
    closing.append(clean)
    want_logits, want_tokens = logits(clean), generate(clean, do_sample=False)
    clean_stats = clean.strata_engine.window.stats()["total"]
    real = engine_module.route_ids
    n_experts = clean.strata_engine.stream.n_experts

    def wrong(router: Router, x: Any) -> Any:
        ids = real(router, x)
        return (ids + 1 + torch.arange(ids.shape[-1])) % n_experts

    monkeypatch.setattr(engine_module, "route_ids", wrong)
    corrupt = fam.load(2 * k)
    closing.append(corrupt)
    got_logits, got_tokens = logits(corrupt), generate(corrupt, do_sample=False)
    assert np.array_equal(got_logits, want_logits)
    assert got_tokens == want_tokens
    stats = corrupt.strata_engine.window.stats()["total"]
    assert stats["pred_predicted"] > 0  # the corrupted predictions were used
    # and were wrong: they hit the experts the model then chose less often than the real ones
    assert stats["pred_correct"] < clean_stats["pred_correct"]


def test_without_a_router_the_profile_predicts_and_stats_say_so(
    fam: Family, closing: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    clean = fam.load(2 * fam.top_k)
    closing.append(clean)
    want_logits, want_tokens = logits(clean), generate(clean, do_sample=False)
    monkeypatch.setattr(engine_module, "find_router", lambda *a, **k: None)
    model = fam.load(2 * fam.top_k)
    closing.append(model)
    assert np.array_equal(logits(model), want_logits)
    assert generate(model, do_sample=False) == want_tokens
    stats = model.strata_engine.stats()
    n = len(model.strata_engine.blocks)
    assert stats["prediction"] == ["profile"] * n and stats["prediction_profile_layers"] == n


def test_find_router_by_the_shape_and_dtype_of_its_outputs() -> None:
    hidden, n_experts, k = 16, 8, 2

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(n_experts, hidden))

        def forward(self, x: Any) -> Any:
            return x @ self.weight.T

    class Triple(Logits):
        def forward(self, x: Any) -> Any:
            logits = super().forward(x)
            w, i = logits.softmax(-1).topk(k, dim=-1)
            return logits, w, i

    class Pair(Logits):  # ids first, in another order than the usual triple
        def forward(self, x: Any) -> Any:
            w, i = super().forward(x).topk(k, dim=-1)
            return i, w

    for router, want in ((Logits(), None), (Triple(), 2), (Pair(), 0)):
        block = torch.nn.Module()
        block.experts = torch.nn.Linear(2, 2)
        block.router = router
        found = find_router(block, "experts", k, n_experts, hidden)
        if want is None:
            assert found is None
        else:
            assert found is not None and found.module is router and found.index == want


def test_another_activation_is_refused_by_name(tmp_path: Path) -> None:
    """qwen3_moe with gelu experts: the converter writes a SwiGLU pack, which would compute
    silu; load refuses instead of computing the wrong function."""
    path = make_checkpoint("qwen3_moe", tmp_path / "gelu", dims={"hidden_act": "gelu"})
    with pytest.raises(ConfigError, match=r"^qwen3_moe: experts module \w+'s gate function "
                       r"\(act_fn GELUActivation\) is not the pack's swiglu") as e:  # fmt: skip
        load(path, pack_path=tmp_path / "gelu.strpk", config=BASE, progress=False)
    assert len(str(e.value).splitlines()) == 1


def test_experts_the_pack_cannot_hold_are_one_line_naming_the_model_type() -> None:
    """ergo's experts (a per-expert norm its own forward applies around the interface's
    dispatch) are taken on; given a weighted module that nothing applies, they are refused in
    one line naming the model type and the module."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root
    from tests.model_coverage.transformers_matrix import tiny_config

    config = tiny_config("ergo")
    model = causal_lm_class(config)._from_config(config)
    blocks = find_blocks(model)
    assert blocks
    experts = getattr(blocks[0][1], blocks[0][2])
    assert family_of(experts, "ergo").own_forward
    experts.unused_scale = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match=r"^ergo: .*\(unused_scale: Linear\); the pack's "
                                          r"experts end at down_proj") as e:  # fmt: skip
        family_of(experts, "ergo")
    assert len(str(e.value).splitlines()) == 1


def test_the_causal_lm_class_is_found_as_transformers_finds_it() -> None:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = CONFIG_MAPPING["mistral4"]()
    if type(config) in transformers.AutoModelForCausalLM._model_mapping:
        pytest.skip("this transformers maps mistral4 in AutoModelForCausalLM")
    assert causal_lm_class(config) is transformers.Mistral4ForCausalLM
    # The table's own choice, by the config's architectures where it has several.
    assert causal_lm_class(transformers.Qwen3MoeConfig()) is transformers.Qwen3MoeForCausalLM
    with pytest.raises(ConfigError, match="no causal LM class for ViTConfig"):
        causal_lm_class(transformers.ViTConfig())


def test_a_vision_model_generates_with_its_image_text_to_text_class() -> None:
    """A vision model with no causal LM of its own loads as the class transformers builds for
    image-text-to-text; a model with neither is one line naming the heads it has."""
    from strata_stream.transformers.loader import generation_class

    vl = getattr(transformers, "Qwen3VLMoeConfig", None)
    if vl is None:
        pytest.skip("this transformers has no qwen3_vl_moe")
    with pytest.raises(ConfigError, match="no causal LM class for Qwen3VLMoeConfig"):
        causal_lm_class(vl())
    assert generation_class(vl()) is transformers.Qwen3VLMoeForConditionalGeneration
    # A causal LM stays the causal LM, even where the type has an image-text-to-text class too.
    assert generation_class(transformers.Qwen3MoeConfig()) is transformers.Qwen3MoeForCausalLM
    with pytest.raises(ConfigError, match=r"no text-generation class .* for ViTConfig .*"
                       r"ViTForImageClassification") as e:  # fmt: skip
        generation_class(transformers.ViTConfig())
    assert len(str(e.value).splitlines()) == 1


def test_two_experts_modules_in_one_layer_are_two_pack_layers() -> None:
    """Experts per modality (ernie4_5_vl_moe's text and vision sets in one decoder layer): each
    experts module is streamed as its own pack layer, in the order of (decoder layer, module
    path), as the converter orders a checkpoint's sets (tests/test_transformers_sets.py)."""
    import copy

    from strata_stream.transformers.experts import EngineSlot
    from strata_stream.transformers.loader import _replace_experts

    config = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        num_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    model = transformers.Qwen3MoeForCausalLM(config)
    block = model.model.layers[1].mlp
    block.a_experts = copy.deepcopy(block.experts)  # registered after, sorted before `experts`
    slot = EngineSlot()
    _replace_experts(model, slot)
    assert [(b[0], b[5]) for b in slot.blocks] == [(0, "experts"), (1, "a_experts"), (1, "experts")]
    assert [getattr(b[2], b[5]).layer for b in slot.blocks] == [0, 1, 2]


def test_describe_reports_the_dense_weights_once(fam: Family, closing: list[Any]) -> None:
    """The dense weights' bytes: plain transformers' tensors, tied ones once, less the experts
    modules the stream replaced."""
    model = fam.load(2 * fam.top_k)
    closing.append(model)
    streamed = {n for n, m in model.named_modules() if isinstance(m, StreamedExperts)}
    assert streamed
    seen: dict[int, int] = {}
    for name, t in (*fam.ref.named_parameters(), *fam.ref.named_buffers()):
        if not any(name.startswith(f"{s}.") for s in streamed):
            seen[t.data_ptr()] = t.numel() * t.element_size()
    assert describe(model)["dense_bytes"] == sum(seen.values()) > 0
