"""Decoder layers with several experts modules (ERNIE-4.5-VL's text and vision experts).

ernie4_5_vl_moe's sparse decoder layers hold two experts modules, ``mlp.text_moe.experts`` and
``mlp.vision_moe.experts``: text tokens route to the one, image tokens to the other. Its
checkpoints list both sets as one per-expert list (``mlp.experts.{e}``: the text experts, then
the vision ones), which transformers' own conversion splits into equal consecutive chunks.

- `convert` writes each set as its own pack layer, in the order of (decoder layer, module
  path), and records the mapping in the pack's model block (`expert_offsets`);
- the streamed model matches plain transformers on text tokens, and on a prompt whose tokens
  go to both sets (``moe_mm_token_type_ids``);
- a pass runs only the sets its tokens route to; the Window's turn moves past the others
  (`Window.pass_layer`) and ends with the pass, and prediction uses a router only for a set
  the same tokens run next (stats say which);
- wrong predictions change no bit of the output;
- a pack of the experts as one set per decoder layer (the layout before this) is refused.

The tiny checkpoint is the coverage matrix's (tests/model_coverage/transformers_matrix.py).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata_stream import ExpertPack, StreamConfig  # noqa: E402
from strata_stream.convert import checkpoint as checkpoint_module  # noqa: E402
from strata_stream.convert import convert  # noqa: E402
from strata_stream.errors import PackError, TurnError  # noqa: E402
from strata_stream.transformers import engine as engine_module  # noqa: E402
from strata_stream.transformers import load  # noqa: E402
from strata_stream.transformers.families import Router  # noqa: E402

TYPE = "ernie4_5_vl_moe"
PROMPT = [3, 17, 5, 42, 8, 11, 29, 2, 60, 33, 7, 14]
# Which prompt tokens are image tokens in the mixed prompt (moe_mm_token_type_ids).
VISION = [0, 0, 1, 1, 1, 0, 0, 1, 0, 0, 1, 0]
TOLERANCE = 1e-5  # of max|logit|, float32 (docs/transformers.md, Parity)

if not hasattr(transformers, "Ernie4_5_VLMoeForConditionalGeneration"):
    pytest.skip(f"this transformers has no {TYPE}", allow_module_level=True)


class Ernie:
    """The tiny checkpoint, its pack, plain transformers and streamed models of it."""

    def __init__(self, root: Path) -> None:
        from tests.model_coverage.transformers_matrix import build_tiny

        self.path = root / TYPE
        built = build_tiny(TYPE, self.path)
        assert built.moe
        self.cls = built.cls
        self.pack = root / f"{TYPE}.strpk"
        convert(self.path, self.pack, progress=False)
        with ExpertPack.open(self.pack) as p:
            self.top_k = p.geometry.top_k
            self.stride = p.record_stride
        self._ref: Any = None

    @property
    def ref(self) -> Any:
        if self._ref is None:
            self._ref = self.cls.from_pretrained(
                str(self.path), dtype=torch.float32, attn_implementation="eager",
                experts_implementation="eager",
            ).eval()  # fmt: skip
        return self._ref

    def load(self, slots: int, **config: Any) -> Any:
        cfg = StreamConfig(io_threads=2, direct_io=False, persist_profile=False, **config)
        return load(
            self.path, pack_path=self.pack, arena_bytes=slots * self.stride, config=cfg,
            dtype=torch.float32, attn_implementation="eager", progress=False,
        )  # fmt: skip


@pytest.fixture(scope="module")
def ernie(tmp_path_factory: pytest.TempPathFactory) -> Ernie:
    return Ernie(tmp_path_factory.mktemp("sets"))


def logits(model: Any, vision: list[int] | None = None) -> np.ndarray:
    kwargs = {} if vision is None else {"moe_mm_token_type_ids": torch.tensor([vision])}
    with torch.no_grad():
        out = model(torch.tensor([PROMPT]), **kwargs).logits[0]
    return out.float().numpy()


def greedy(model: Any) -> list[int]:
    out = model.generate(torch.tensor([PROMPT]), max_new_tokens=6, do_sample=False)
    return [int(t) for t in out[0, len(PROMPT) :]]


def close_to(got: np.ndarray, want: np.ndarray) -> bool:
    return float(np.abs(got - want).max()) <= TOLERANCE * float(np.abs(want).max())


def test_each_experts_set_is_its_own_pack_layer(ernie: Ernie) -> None:
    from safetensors import safe_open

    with ExpertPack.open(ernie.pack) as p:
        model = p.metadata["model"]
        n = p.geometry.n_experts
        # Two sparse decoder layers (1, 2), two sets each: the text experts, then the vision.
        assert model["decoder_layers"] == [1, 1, 2, 2]
        assert model["expert_offsets"] == [0, n, 0, n]
        assert p.geometry.n_layers == 4
        config = ernie.ref.config.get_text_config()
        assert n == config.moe_num_experts
        # Pack layer 3's expert e is the checkpoint's vision expert n + e of decoder layer 2.
        files = list(ernie.path.glob("*.safetensors"))
        with safe_open(str(files[0]), "np") as f:
            for layer, decoder_layer, offset in ((0, 1, 0), (3, 2, n)):
                for e in (0, n - 1):
                    name = f"model.layers.{decoder_layer}.mlp.experts.{offset + e}.up_proj.weight"
                    want = f.get_tensor(name)
                    _, up, _ = p.expert_weights(layer, e)
                    assert np.array_equal(np.asarray(up, dtype=np.float32), want)


def test_text_tokens_stream_as_plain_transformers(ernie: Ernie, closing: list[Any]) -> None:
    model = ernie.load(2 * ernie.top_k + 1)
    closing.append(model)
    assert close_to(logits(model), logits(ernie.ref))
    assert greedy(model) == greedy(ernie.ref)
    engine = model.strata_engine
    stats = engine.stats()
    # Text tokens never run the vision sets: each pass moved past them, and its turn ended.
    assert stats["passed_layers"] > 0
    assert not engine.window.in_turn
    per_layer = stats["layers"]
    assert [per_layer[i]["calls"] > 0 for i in range(4)] == [True, False, True, False]
    # The text set of decoder layer 2 is predicted from decoder layer 1's text set (two pack
    # layers before), the vision set of layer 1 by nothing before it.
    assert stats["prediction"] == ["router", "none", "two_layer", "two_layer"]
    assert (stats["prediction_two_layer_layers"], stats["prediction_none_layers"]) == (2, 1)


def test_tokens_of_both_sets_stream_as_plain_transformers(ernie: Ernie, closing: list[Any]) -> None:
    model = ernie.load(2 * ernie.top_k + 1)
    closing.append(model)
    want = logits(ernie.ref, VISION)
    # The vision experts change the output (else this would not test them).
    assert not close_to(logits(ernie.ref), want)
    assert close_to(logits(model, VISION), want)
    per_layer = model.strata_engine.stats()["layers"]
    assert all(per_layer[i]["calls"] > 0 for i in range(4))
    # Every token an image token: the text sets run no rows and are passed.
    every = [1] * len(PROMPT)
    assert close_to(logits(model, every), logits(ernie.ref, every))
    assert not model.strata_engine.window.in_turn


def test_a_corrupted_predictor_costs_io_never_output(
    ernie: Ernie, closing: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Wrong ids from every router the engine predicts with (two-layer prediction on, so that
    the sets' predictions run): the output stays bitwise the clean run's."""
    on = {"two_layer_decode": True, "two_layer_prompt": True}
    clean = ernie.load(2 * ernie.top_k + 1, **on)
    closing.append(clean)
    want = (logits(clean), logits(clean, VISION), greedy(clean))
    real = engine_module.route_ids
    called: list[int] = []

    def wrong(router: Router, x: Any) -> Any:
        called.append(1)
        ids = real(router, x)
        return (ids + 1 + torch.arange(ids.shape[-1])) % clean.strata_engine.stream.n_experts

    monkeypatch.setattr(engine_module, "route_ids", wrong)
    corrupt = ernie.load(2 * ernie.top_k + 1, **on)
    closing.append(corrupt)
    got = (logits(corrupt), logits(corrupt, VISION), greedy(corrupt))
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    assert got[2] == want[2]
    assert called  # the corrupted predictions were made (two layers ahead: not scored)


def test_a_pack_of_one_set_per_decoder_layer_is_refused(
    ernie: Ernie, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The experts list as one set of 2E experts per decoder layer (no split): the pack says
    which decoder layers its layers are, and load refuses it by that, naming both."""
    monkeypatch.setattr(checkpoint_module, "_split_sets", lambda _listed, _c, layers: layers)
    pack = tmp_path / "one-set.strpk"
    convert(ernie.path, pack, progress=False)
    with ExpertPack.open(pack) as p:
        assert p.metadata["model"]["decoder_layers"] == [1, 2]
    with pytest.raises(PackError, match=r"decoder layers \[1, 2\].* \[1, 1, 2, 2\]") as e:
        load(ernie.path, pack_path=pack, progress=False, dtype=torch.float32)
    assert len(str(e.value).splitlines()) == 1


def test_sets_of_different_widths_are_refused_in_one_line(tmp_path: Path) -> None:
    """ERNIE-4.5-VL's released checkpoints have narrower vision experts than text ones: the pack
    holds experts of one shape, so convert says so, naming the set."""
    from tests.model_coverage.transformers_matrix import tiny_config

    from strata_stream.errors import ConfigError
    from strata_stream.transformers.loader import config_for, generation_class
    from strata_stream.transformers.random_model import randomize

    config = tiny_config(TYPE)
    text = config.get_text_config()
    wide = text.moe_intermediate_size[0]
    text.moe_intermediate_size = [wide, wide // 2]
    cls = generation_class(config)
    model = cls._from_config(config_for(cls, config), dtype=torch.float32)
    randomize(model, 0)
    model.save_pretrained(str(tmp_path / "ckpt"))
    n = text.moe_num_experts
    with pytest.raises(
        ConfigError, match=rf"decoder layer 1's experts {n}\.\.{2 * n - 1} of .*mlp\.experts are "
        rf"{n} of intermediate width {wide // 2}, the first layer's {n} of {wide}"
    ) as e:  # fmt: skip
        convert(tmp_path / "ckpt", tmp_path / "p.strpk", progress=False)
    assert len(str(e.value).splitlines()) == 1


def test_pass_layer_moves_the_turn_past_a_layer(make_pack: Any) -> None:
    """Window.pass_layer: opens the turn at layer 0, keeps the layer order, ends it after the
    last layer; the layers called around a passed one compute what they compute alone."""
    from strata_stream import ExpertStream, Window

    cfg = StreamConfig(io_threads=2, direct_io=False, persist_profile=False)
    with ExpertStream(make_pack(), cfg) as stream, Window(stream) as w:
        n, h = w.n_layers, 64  # make_pack's hidden size
        assert n >= 4
        x = np.random.default_rng(0).standard_normal((2, h)).astype(np.float32)
        ids = np.array([[0, 5], [9, 3]], np.int32)
        weights = np.full(ids.shape, 0.5, np.float32)
        alone = [w.moe_routed(layer, x, ids, weights) for layer in range(n)]
        assert not w.in_turn
        w.pass_layer(0)  # opens the turn
        assert w.in_turn and w.next_layer == 1
        with pytest.raises(TurnError, match="out of order"):
            w.pass_layer(2)
        w.restart_pass()
        assert np.array_equal(w.moe_routed(0, x, ids, weights), alone[0])
        w.pass_layer(1)
        assert np.array_equal(w.moe_routed(2, x, ids, weights), alone[2])
        for layer in range(3, n):
            w.pass_layer(layer)
        assert not w.in_turn  # ended after the last layer
        assert w.stats()["layers"][1]["calls"] == 1  # a passed layer ran no call
