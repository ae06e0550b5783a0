"""Experts with a norm after each expert, streamed, against plain transformers.

Two mechanisms of the experts interface, one tiny random checkpoint each (built as the coverage
matrix builds its rows: tests/model_coverage/transformers_matrix.py):

- muse_spark: the experts class is decorated with ``has_post_expert_norm``, so every backend
  applies the module's ``post_expert_norm`` to each route's down-projection output before the
  mixture weights. The engine computes each route's output apart, the model's own norm module
  (resident, loaded by from_pretrained) normalises it, then the weights and the sum.
- ergo: the decorated class is the projections class; ``ErgoExperts``' own forward calls its
  dispatch once per route (each token repeated, unit weights) and applies its per-expert norm
  itself. The dispatch is streamed and that forward runs unchanged.

Plain transformers (eager attention and experts) on the same weights is the oracle: float32
teacher-forced logits within 1e-5 of max|logit| and the same greedy tokens, at an arena of two
layers' top-k records and one (the matrix's).
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

from safetensors.torch import load_file, save_file  # noqa: E402
from tests.model_coverage.transformers_matrix import tiny_config  # noqa: E402
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS  # noqa: E402
from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402

from strata_stream import ExpertPack, StreamConfig  # noqa: E402
from strata_stream.convert import convert  # noqa: E402
from strata_stream.errors import ConfigError  # noqa: E402
from strata_stream.transformers import load  # noqa: E402
from strata_stream.transformers.families import interface_class  # noqa: E402
from strata_stream.transformers.loader import config_for, generation_class  # noqa: E402
from strata_stream.transformers.random_model import randomize  # noqa: E402

PROMPT = [5, 9, 12, 3, 40, 22, 7, 8, 9, 10, 33, 2, 17, 61, 4, 4, 30, 12, 50, 6]
NEW_TOKENS = 8
TOLERANCE = 1e-5
BASE = StreamConfig(io_threads=2, direct_io=False, persist_profile=False)


def _needs(model_type: str) -> None:
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")


def _build(config: Any) -> tuple[type[Any], Any]:
    cls = generation_class(config)
    torch.manual_seed(0)
    model = cls._from_config(config_for(cls, config), dtype=torch.float32)
    randomize(model, 0)
    model.config.dtype = "float32"
    return cls, model


def _oracle(cls: type[Any], path: Path) -> Any:
    return cls.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager",
        experts_implementation="eager",
    ).eval()  # fmt: skip


def _streamed(path: Path, tmp: Path) -> Any:
    pack = tmp / "experts.strpk"
    convert(path, pack, progress=False)
    with ExpertPack.open(pack) as p:
        arena = (2 * p.geometry.top_k + 1) * p.record_stride
    return load(
        path, pack_path=pack, arena_bytes=arena, config=BASE, dtype=torch.float32,
        attn_implementation="eager", progress=False,
    )  # fmt: skip


@torch.no_grad()
def _run(model: Any) -> tuple[np.ndarray, list[int]]:
    logits = model(torch.tensor([PROMPT])).logits[0].float().numpy()
    out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False)
    return logits, [int(t) for t in out[0, len(PROMPT) :]]


def _assert_same(ref: tuple[np.ndarray, list[int]], got: tuple[np.ndarray, list[int]]) -> None:
    scale = float(np.abs(ref[0]).max())
    assert float(np.abs(got[0] - ref[0]).max()) <= TOLERANCE * scale
    assert got[1] == ref[1]


def _norms(model: Any) -> dict[str, Any]:
    return {n: p for n, p in model.named_parameters() if ".experts.post_expert_norm." in n}


def test_muse_spark_post_expert_norm_streams(tmp_path: Path) -> None:
    _needs("muse_spark")
    config = tiny_config("muse_spark")
    text = config.get_text_config()
    # The experts at the decoder's own width: the converter reads the experts' width from
    # config.json's hidden_size (muse_spark's experts work at moe_hidden_size, between the
    # block's own projections).
    text.moe_hidden_size = text.hidden_size
    cls, model = _build(config)
    model.save_pretrained(str(tmp_path / "ckpt"))
    del model
    oracle = _oracle(cls, tmp_path / "ckpt")
    ref = _run(oracle)
    streamed = _streamed(tmp_path / "ckpt", tmp_path)
    try:
        # The norm stays the model's, resident, with the checkpoint's weights (counted with the
        # dense weights, which are every parameter the model still holds).
        norms, want = _norms(streamed), _norms(oracle)
        assert norms and norms.keys() == want.keys()
        for name, p in norms.items():
            assert torch.equal(p, want[name]) and not torch.all(p == 0), name
        _assert_same(ref, _run(streamed))
    finally:
        streamed.strata_engine.close()


def _per_expert_copy(dst: Path, model: Any) -> None:
    """`model` saved in transformers' own names with its stacked experts as per-expert
    Linear weights (``experts.{e}.up_proj.weight [I, H]``): the layout the converter reads for
    gateless experts. ergo's own checkpoint layout (``feed_forward.up_proj [E, H, I]``, which
    transformers' conversion mapping renames on load) is not one of them. The streamed model
    loads from this copy (the pack must come from the checkpoint it streams), the oracle from
    the model's own checkpoint: the same weights."""
    model.save_pretrained(str(dst), save_original_format=False)
    for f in dst.glob("*.safetensors"):
        tensors = load_file(str(f))
        out = {}
        for name, t in tensors.items():
            base, _, mat = name.rpartition(".")
            if base.endswith(".experts") and mat in ("up_proj", "down_proj"):
                for e in range(t.shape[0]):  # transposed experts: [E, in, out]
                    out[f"{base}.{e}.{mat}.weight"] = t[e].T.contiguous()
            else:
                out[name] = t
        save_file(out, str(f), metadata={"format": "pt"})


def test_ergo_per_expert_norm_around_the_streamed_dispatch(tmp_path: Path) -> None:
    _needs("ergo")
    cls, model = _build(tiny_config("ergo"))
    model.save_pretrained(str(tmp_path / "ckpt"))
    _per_expert_copy(tmp_path / "per_expert", model)
    del model
    oracle = _oracle(cls, tmp_path / "ckpt")
    ref = _run(oracle)
    streamed = _streamed(tmp_path / "per_expert", tmp_path)
    try:
        norms, want = _norms(streamed), _norms(oracle)
        assert norms and norms.keys() == want.keys()
        for name, p in norms.items():
            assert torch.equal(p, want[name]), name
        # The model's own experts forward runs; only its projections are gone.
        experts = streamed.model.layers[1].mlp.experts
        assert type(experts).forward is type(oracle.model.layers[1].mlp.experts).forward
        assert not any(n.endswith("_proj") for n, _ in experts.named_parameters())
        _assert_same(ref, _run(streamed))

        # The dispatch called with one route a row, rows that are no token's repeated routes
        # (any caller's): each row its own expert's output times its weight, as transformers'
        # batched_mm backend computes it (ergo's eager dispatch ignores the weights: its caller
        # passes ones).
        gen = torch.Generator().manual_seed(3)
        rows = 7
        x = torch.randn(rows, oracle.config.hidden_size, generator=gen)
        ids = torch.randint(0, oracle.config.num_experts, (rows, 1), generator=gen)
        weights = torch.rand(rows, 1, generator=gen)
        plain = oracle.model.layers[1].mlp.experts
        with torch.no_grad():
            want_rows = ALL_EXPERTS_FUNCTIONS["batched_mm"](plain, x, ids, weights)
            assert torch.allclose(  # the backend is the eager dispatch's arithmetic at weight 1
                ALL_EXPERTS_FUNCTIONS["batched_mm"](plain, x, ids, torch.ones_like(weights)),
                interface_class(plain).forward(plain, x, ids, torch.ones_like(weights)),
                rtol=0, atol=TOLERANCE * float(want_rows.abs().max()),
            )  # fmt: skip
        got_rows = streamed.strata_engine.run(0, x, ids, weights)
        scale = float(want_rows.abs().max())
        assert float((got_rows - want_rows).abs().max()) <= TOLERANCE * scale
        # Runs of top_k equal rows (ergo's repeat per route) from a non-contiguous x: each
        # route's output, as its token's routing computes it.
        top_k = oracle.config.num_experts_per_tok
        tokens = torch.randn(oracle.config.hidden_size, 3, generator=gen).T  # [3, H], strided
        repeated = tokens.repeat_interleave(top_k, dim=0).T.contiguous().T  # [3k, H], strided
        assert not repeated.is_contiguous()
        ids = torch.randint(0, oracle.config.num_experts, (3 * top_k, 1), generator=gen)
        with torch.no_grad():
            want_rows = interface_class(plain).forward(plain, repeated, ids, torch.ones_like(ids))
        got_rows = streamed.strata_engine.run(0, repeated, ids, torch.ones(3 * top_k, 1))
        scale = float(want_rows.abs().max())
        assert float((got_rows - want_rows).abs().max()) <= TOLERANCE * scale
        with pytest.raises(ConfigError, match=f"called with 6 ids for 2 rows; the pack routes "
                                              f"{top_k} a token, or one a row"):  # fmt: skip
            streamed.strata_engine.run(0, x[:2], torch.zeros(2, 3, dtype=torch.long),
                                       torch.ones(2, 3))  # fmt: skip
    finally:
        streamed.strata_engine.close()
