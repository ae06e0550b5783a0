"""The synthetic residual-stream driver: determinism, shapes, continuity, realistic reuse."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import numpy.typing as npt
import pytest

from strata_stream.errors import ConfigError
from strata_stream.pack import Geometry
from strata_stream.synthetic import DriverKnobs, SyntheticDriver, route_ids

F32 = npt.NDArray[np.float32]
# 7 * n_experts <= hidden: every router sees only its own layer's part of an input, as at
# full size (Qwen3-30B-A3B: 7 * 128 <= 2048).
GEOM = Geometry(n_layers=8, n_experts=32, top_k=4, hidden=256, moe_intermediate=32)


def routers(geometry: Geometry, seed: int = 0) -> list[F32]:
    rng = np.random.default_rng((seed, 7))
    shape = (geometry.n_experts, geometry.hidden)
    return [
        (rng.standard_normal(shape) / np.sqrt(geometry.hidden)).astype(np.float32)
        for _ in range(geometry.n_layers)
    ]


def sequence_inputs(driver: SyntheticDriver, n_prompt: int, n_decode: int) -> list[list[F32]]:
    """Per layer, the inputs of a prompt then `n_decode` single decode tokens."""
    runs = [driver.prompt(n_prompt)] + [driver.decode() for _ in range(n_decode)]
    return [[run.layer_input(layer) for run in runs] for layer in range(GEOM.n_layers)]


def test_deterministic_by_seed_and_order_free() -> None:
    rs = routers(GEOM)
    a = sequence_inputs(SyntheticDriver(GEOM, rs, seed=3), 5, 3)
    b = SyntheticDriver(GEOM, lambda layer: rs[layer], seed=3)
    runs = [b.prompt(5)] + [b.decode() for _ in range(3)]
    # Layers asked for in reverse: a layer input must not depend on what was computed before.
    for layer in reversed(range(GEOM.n_layers)):
        for i, run in enumerate(runs):
            np.testing.assert_array_equal(run.layer_input(layer), a[layer][i])
    c = sequence_inputs(SyntheticDriver(GEOM, rs, seed=4), 5, 3)
    assert not np.array_equal(a[0][0], c[0][0])


def test_shapes_and_dtypes() -> None:
    driver = SyntheticDriver(GEOM, routers(GEOM))
    prompt = driver.prompt(7)
    assert prompt.n == 7 and driver.decode().n == 1
    for layer in range(GEOM.n_layers):
        x = prompt.layer_input(layer)
        assert x.dtype == np.float32 and x.shape == (7, GEOM.hidden)
        assert np.isfinite(x).all()
        ids = route_ids(x, driver.router(layer), GEOM.top_k)
        assert ids.dtype == np.int32 and ids.shape == (7, GEOM.top_k)
    with pytest.raises(ConfigError):
        prompt.layer_input(GEOM.n_layers)
    with pytest.raises(ConfigError):
        DriverKnobs(persistence=1.5)


def cosine(a: F32, b: F32) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_decode_continues_the_prompt() -> None:
    rs = routers(GEOM)
    driver = SyntheticDriver(GEOM, rs, seed=1)
    prompt, first = driver.prompt(16), driver.decode()
    other = SyntheticDriver(GEOM, rs, seed=2).prompt(16)
    # Averaged over layers (and unrelated tokens): single pairs at this width are noisy.
    related, unrelated = [], []
    for layer in range(GEOM.n_layers):
        nxt = first.layer_input(layer)[0]
        related.append(cosine(prompt.layer_input(layer)[-1], nxt))
        unrelated += [cosine(o, nxt) for o in other.layer_input(layer)]
    assert np.mean(related) > np.mean(unrelated) + 0.2


def lru_hit_rate(ids: list[npt.NDArray[np.int32]], slots: int) -> float:
    """ids[layer]: [T, k]; one LRU cache over all layers, token by token, layer by layer."""
    cache: OrderedDict[tuple[int, int], None] = OrderedDict()
    hits = total = 0
    for t in range(len(ids[0])):
        for layer, layer_ids in enumerate(ids):
            for e in layer_ids[t]:
                key = (layer, int(e))
                hits += key in cache
                total += 1
                cache[key] = None
                cache.move_to_end(key)
                if len(cache) > slots:
                    cache.popitem(last=False)
    return hits / total


def reuse_and_recall(inputs: list[F32], rs: list[F32]) -> tuple[float, float]:
    """(LRU hit rate with a quarter of all experts cached, next-layer prediction recall)."""
    k = GEOM.top_k
    ids = [route_ids(x, r, k) for x, r in zip(inputs, rs, strict=True)]
    predicted = [route_ids(x, r, k) for x, r in zip(inputs[:-1], rs[1:], strict=True)]
    pairs = zip(predicted, ids[1:], strict=True)
    recall = np.mean([(p[:, :, None] == a[:, None, :]).any(axis=2).mean() for p, a in pairs])
    return lru_hit_rate(ids, GEOM.n_records // 4), float(recall)


def test_reuse_and_prediction_beat_random_routing() -> None:
    rs = routers(GEOM)
    # All tokens one after another as decode steps, each layer's inputs stacked [T, hidden].
    per_layer = sequence_inputs(SyntheticDriver(GEOM, rs), 1, 63)
    inputs = [np.concatenate(xs) for xs in per_layer]
    rng = np.random.default_rng(0)
    noise = [rng.standard_normal(x.shape).astype(np.float32) for x in inputs]
    hit, recall = reuse_and_recall(inputs, rs)
    hit0, recall0 = reuse_and_recall(noise, rs)
    # Random routing: hit rate ~ cached share (0.25), recall ~ k / n_experts (0.125).
    assert hit0 < 0.35 and recall0 < 0.25
    assert hit > hit0 + 0.2
    assert recall > 0.7
