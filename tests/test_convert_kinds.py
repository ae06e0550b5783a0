"""strata-stream convert on experts that need pack format version 4: the activation config.json
names for the routed experts, and gateless experts (per-expert ``up_proj`` / ``down_proj``, as
nemotron_h's save_pretrained writes them) packed as up and down only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

from strata_stream.convert import convert
from strata_stream.errors import ConfigError
from strata_stream.pack import ExpertPack

E, H, INTER = 4, 64, 32


def _checkpoint(path: Path, config: dict[str, Any], gated: bool = True) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    tensors: dict[str, np.ndarray] = {}
    for layer in range(2):
        for e in range(E):
            p = f"backbone.layers.{layer}.mixer.experts.{e}"
            if gated:
                tensors[f"{p}.gate_proj.weight"] = rng.standard_normal((INTER, H), np.float32)
            tensors[f"{p}.up_proj.weight"] = rng.standard_normal((INTER, H), np.float32)
            tensors[f"{p}.down_proj.weight"] = rng.standard_normal((H, INTER), np.float32)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    base = {"hidden_size": H, "num_experts_per_tok": 2, "num_hidden_layers": 2}
    (path / "config.json").write_text(json.dumps({**base, **config}))
    return tensors


def test_gateless_experts_pack_up_and_down(tmp_path: Path) -> None:
    tensors = _checkpoint(tmp_path / "m", {"model_type": "nemotron_h", "mlp_hidden_act": "relu2"},
                          gated=False)  # fmt: skip
    convert(tmp_path / "m", tmp_path / "p.strpk", progress=False)
    with ExpertPack.open(tmp_path / "p.strpk") as pack:
        g = pack.geometry
        assert (g.activation, g.gated, pack.header.version) == ("relu2", False, 4)
        for layer in range(2):
            for e in range(E):
                _, up, down = pack.expert_weights(layer, e)
                p = f"backbone.layers.{layer}.mixer.experts.{e}"
                np.testing.assert_array_equal(up, tensors[f"{p}.up_proj.weight"])
                np.testing.assert_array_equal(down, tensors[f"{p}.down_proj.weight"])


def test_gateless_experts_of_another_activation_are_refused(tmp_path: Path) -> None:
    _checkpoint(tmp_path / "m", {"model_type": "x", "mlp_hidden_act": "gelu"}, gated=False)
    with pytest.raises(ConfigError, match="have no gate and activation gelu; the pack computes "
                                          "gateless experts with relu2 only"):  # fmt: skip
        convert(tmp_path / "m", tmp_path / "p.strpk", progress=False)


@pytest.mark.parametrize(
    ("config", "want"),
    [
        ({"model_type": "qwen3_moe", "hidden_act": "silu"}, ("swiglu", 0.0, 0.0, 2)),
        ({"model_type": "gpt_oss"}, ("swiglu_oai", 1.702, 7.0, 2)),
        ({"model_type": "hy_v4", "hidden_act": "silu", "swiglu_limit": 10.0},
         ("swiglu_clamp", 0.0, 10.0, 4)),
        ({"model_type": "gemma4_text", "hidden_activation": "gelu_pytorch_tanh"},
         ("geglu_tanh", 0.0, 0.0, 4)),
        ({"model_type": "inkling2", "hidden_act": "silu", "mlp_gate_softcap": 4.0,
          "mlp_up_softcap": 25.0}, ("swiglu_softcap", 4.0, 25.0, 4)),
        # the text model's settings win over a vision tower's at the top level
        ({"model_type": "vl", "hidden_act": "gelu_pytorch_tanh",
          "text_config": {"hidden_act": "silu"}}, ("swiglu", 0.0, 0.0, 2)),
    ],
)  # fmt: skip
def test_the_activation_config_json_names(
    tmp_path: Path, config: dict[str, Any], want: tuple[str, float, float, int]
) -> None:
    _checkpoint(tmp_path / "m", config)
    convert(tmp_path / "m", tmp_path / "p.strpk", progress=False)
    with ExpertPack.open(tmp_path / "p.strpk") as pack:
        g = pack.geometry
        assert (g.activation, g.act_alpha, g.act_limit, pack.header.version) == pytest.approx(want)


def test_a_pack_converted_with_another_activation_is_out_of_date(tmp_path: Path) -> None:
    """A cached pack of the same weights whose activation is not the one config.json names
    now (an older strata-stream wrote gemma4's experts as swiglu) is converted again."""
    from strata_stream.convert.pack_cache import stale_reason

    ckpt = tmp_path / "m"
    _checkpoint(ckpt, {"model_type": "qwen3_moe", "hidden_act": "silu"})
    convert(ckpt, tmp_path / "p.strpk", progress=False)
    assert stale_reason(tmp_path / "p.strpk", ckpt) is None
    config = json.loads((ckpt / "config.json").read_text())
    config["hidden_activation"] = "gelu_pytorch_tanh"
    (ckpt / "config.json").write_text(json.dumps(config))
    reason = stale_reason(tmp_path / "p.strpk", ckpt)
    assert reason == (
        "it computes the experts with activation swiglu, and the model's config.json names "
        "geglu_tanh"
    )
