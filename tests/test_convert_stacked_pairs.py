"""strata-stream convert on two experts layouts transformers' experts interface holds and its
save_pretrained writes: gateless experts as a bare stacked pair (ergo's checkpoints'
``feed_forward.up_proj [E, H, I]`` with ``down_proj [E, I, H]``; transformers' own
``experts.up_proj [E, I, H]`` with ``down_proj [E, H, I]``), and fused experts that work at a
width of their own, not config.json's hidden_size (muse_spark's moe_hidden_size, between the
block's own projections)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from strata_stream.convert import convert
from strata_stream.pack import ExpertPack

E, H, INTER = 4, 64, 32


def _write(path: Path, tensors: dict[str, np.ndarray], config: dict[str, object]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    base = {"hidden_size": H, "num_experts_per_tok": 2, "num_hidden_layers": 2}
    (path / "config.json").write_text(json.dumps({**base, **config}))


@pytest.mark.parametrize(
    ("prefix", "transposed"),
    [("layers.{l}.feed_forward", True), ("model.layers.{l}.mlp.experts", False)],
)
def test_a_bare_stacked_up_down_pair_is_gateless_experts(
    tmp_path: Path, prefix: str, transposed: bool
) -> None:
    rng = np.random.default_rng(5)
    tensors: dict[str, np.ndarray] = {}
    for layer in range(2):
        p = prefix.format(l=layer)
        up, down = ((E, H, INTER), (E, INTER, H)) if transposed else ((E, INTER, H), (E, H, INTER))
        tensors[f"{p}.up_proj"] = rng.standard_normal(up, np.float32)
        tensors[f"{p}.down_proj"] = rng.standard_normal(down, np.float32)
        # A dense parameter of the same name is not an expert (2-D).
        tensors[f"layers.{layer}.shared.up_proj"] = rng.standard_normal((H, H), np.float32)
    _write(tmp_path / "m", tensors, {"model_type": "ergo"})
    convert(tmp_path / "m", tmp_path / "p.strpk", progress=False)
    with ExpertPack.open(tmp_path / "p.strpk") as pack:
        g = pack.geometry
        assert (g.activation, g.gated, g.hidden, g.moe_intermediate) == ("relu2", False, H, INTER)
        for layer in range(2):
            p = prefix.format(l=layer)
            for e in range(E):
                _, up, down = pack.expert_weights(layer, e)
                want_up, want_down = tensors[f"{p}.up_proj"][e], tensors[f"{p}.down_proj"][e]
                if transposed:
                    want_up, want_down = want_up.T, want_down.T
                np.testing.assert_array_equal(up, want_up)
                np.testing.assert_array_equal(down, want_down)


def test_fused_experts_of_a_width_of_their_own_take_it_from_their_tensors(
    tmp_path: Path,
) -> None:
    width = 3 * H  # the experts' width, between the block's own projections
    rng = np.random.default_rng(6)
    tensors: dict[str, np.ndarray] = {}
    for layer in range(2):
        p = f"model.layers.{layer}.mlp.experts"
        tensors[f"{p}.gate_up_proj"] = rng.standard_normal((E, 2 * INTER, width), np.float32)
        tensors[f"{p}.down_proj"] = rng.standard_normal((E, width, INTER), np.float32)
    _write(tmp_path / "m", tensors, {"model_type": "muse_spark_text"})
    convert(tmp_path / "m", tmp_path / "p.strpk", progress=False)
    with ExpertPack.open(tmp_path / "p.strpk") as pack:
        g = pack.geometry
        assert (g.hidden, g.moe_intermediate, g.gated) == (width, INTER, True)
        for layer in range(2):
            p = f"model.layers.{layer}.mlp.experts"
            for e in range(E):
                gu, down = tensors[f"{p}.gate_up_proj"][e], tensors[f"{p}.down_proj"][e]
                got = pack.expert_weights(layer, e)
                for want, have in zip((gu[:INTER], gu[INTER:], down), got, strict=True):
                    np.testing.assert_array_equal(have, want)
