"""A streamed MoE block called with B sequences at once (mlx-lm's batched decode: x [B, 1, H])
computes every row bitwise as it computes that row alone, for every family, both expert paths
and both CPU arithmetics, at the minimum arena (prompt waves) and all-resident (the decode path
for the whole batch). This is I11 across batch sizes: a client's output does not depend on who
else is being served.

And the path taken: a routed batch stays on the decode path (no waves) while the union of its
rows' experts fits one decode submission, and runs waves beyond it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from mlx_models import CONFIGS, make_checkpoint  # noqa: E402
from strata_stream import ExpertPack, StreamConfig  # noqa: E402
from strata_stream.convert import convert  # noqa: E402
from strata_stream.mlx_lm import load  # noqa: E402

BASE = StreamConfig(io_threads=2, direct_io=False, persist_profile=False)
BATCHES = (3, 12)  # <= decode_rows, and beyond it (the batched decode path or waves)
# (experts, arithmetic) of the three ways a block computes its experts.
PATHS = [("cpu", "auto"), ("cpu", "float32"), ("mlx", "auto")]


@pytest.fixture(scope="module", params=list(CONFIGS))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp(request.param)
    path = make_checkpoint(request.param, root / "model")
    pack = convert(path, root / "experts.strpk", progress=False)
    with ExpertPack.open(pack) as p:
        return path, pack, p.record_stride, p.geometry.n_records, p.geometry.top_k


def moe_modules(model: Any) -> list[Any]:
    """The model's streamed blocks in decoder order (one turn of the engine is one pass)."""
    engine = model.strata_engine
    out = []
    for ref in engine.blocks:
        layer = model.layers[ref.decoder_layer]
        out.append(getattr(layer, "mlp", None) or layer.block_sparse_moe)
    return out


def run_blocks(modules: list[Any], x: Any) -> list[np.ndarray]:
    """Every streamed block on the same x, in order: one engine turn."""
    ys = [m(x) for m in modules]
    mx.eval(ys)
    return [np.array(y.astype(mx.float32)) for y in ys]


@pytest.mark.parametrize(("experts", "arithmetic"), PATHS)
@pytest.mark.parametrize("arena", ["minimum", "all"])
def test_each_row_of_a_batch_is_bitwise_the_row_alone(
    family: Any, experts: str, arithmetic: str, arena: str
) -> None:
    path, pack, stride, n_records, top_k = family
    slots = 2 * top_k if arena == "minimum" else n_records
    model, _ = load(str(path), pack_path=pack, arena_bytes=slots * stride, config=BASE,
                    experts=experts, arithmetic=arithmetic, progress=False)  # fmt: skip
    try:
        modules = moe_modules(model)
        hidden = model.strata_engine.hidden
        rng = np.random.default_rng(7)
        for b in BATCHES:
            x = mx.array(rng.standard_normal((b, 1, hidden)).astype(np.float32)).astype(mx.bfloat16)
            batched = run_blocks(modules, x)
            for layer_out in batched:
                assert np.isfinite(layer_out).all()
            for row in range(b):
                alone = run_blocks(modules, x[row : row + 1])
                for layer, (whole, one) in enumerate(zip(batched, alone, strict=True)):
                    assert np.array_equal(whole[row : row + 1], one), (
                        f"batch {b}, row {row}, MoE layer {layer}: "
                        f"max |diff| {np.abs(whole[row : row + 1] - one).max()}"
                    )
        # Rows differ (the comparison would be vacuous if every row routed and summed alike).
        assert not np.array_equal(batched[0][0], batched[0][1])
    finally:
        model.strata_engine.close()


def test_a_routed_batch_stays_on_the_decode_path_while_its_experts_fit(family: Any) -> None:
    path, pack, stride, n_records, top_k = family
    b = 12  # beyond decode_rows (4): the engine's own routing would run it as a prompt
    for slots, decode in ((n_records + top_k, True), (2 * top_k, False)):
        model, _ = load(str(path), pack_path=pack, arena_bytes=slots * stride, config=BASE,
                        experts="cpu", progress=False)  # fmt: skip
        try:
            window = model.strata_engine.window
            modules = moe_modules(model)
            rows = np.random.default_rng(3).standard_normal((b, 1, model.strata_engine.hidden))
            x = mx.array(rows.astype(np.float32)).astype(mx.bfloat16)
            window.reset_stats()
            run_blocks(modules, x)  # one turn: every MoE layer once
            waves = window.stats()["total"]["waves"]
            kept = window.stats()["scratch_bytes"]
        finally:
            model.strata_engine.close()
        # All experts fit: one decode submission per layer, no wave. The minimum arena holds
        # one top-k per layer call: 12 rows choose more, so they run in waves.
        assert (waves == 0) == decode, (slots, waves)
        # A decode batch's scratch stays for the next step; a prompt's goes back at turn end.
        assert (kept > 0) == decode, (slots, kept)


def test_decode_batch_rows_bounds_the_batched_decode_path(family: Any) -> None:
    path, pack, stride, n_records, top_k = family
    model, _ = load(str(path), pack_path=pack, arena_bytes=(n_records + top_k) * stride,
                    config=BASE.replace(decode_batch_rows=8), experts="cpu",
                    progress=False)  # fmt: skip
    try:
        window = model.strata_engine.window
        modules = moe_modules(model)
        rng = np.random.default_rng(5)
        for b, want_waves in ((8, False), (9, True)):
            x = mx.array(rng.standard_normal((b, 1, model.strata_engine.hidden))
                         .astype(np.float32)).astype(mx.bfloat16)  # fmt: skip
            window.reset_stats()
            run_blocks(modules, x)
            assert (window.stats()["total"]["waves"] > 0) == want_waves, b
    finally:
        model.strata_engine.close()
