"""moce (cache-aware routing): selection, stats, exactness given the selection, determinism.

The numpy reference (oracle.moce_reference) recomputes each call's selection from the router
equations and the residency the route read from smap (Window.route_residency); the block is then
checked against the oracle evaluated with that selection, and the reported probability mass moved
and replaced choices against the reference's. A small arena makes residency partial, so
selections really change (asserted), and a wrong selection, weight or count fails the test.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import PackFactory, random_turns, run_turns
from oracle import moce_reference, moe_reference_selected
from strata_stream import ExpertPack, ExpertStream, StreamConfig, Window, testing
from strata_stream.errors import ConfigError

L, E, K, H, INTER = 4, 16, 4, 64, 48


def config(path: Path, n_slots: int, **kw: Any) -> StreamConfig:
    with ExpertPack.open(path) as p:
        stride = p.record_stride
    base: dict[str, Any] = dict(
        arena_bytes=n_slots * stride, io_threads=2, direct_io=False, persist_profile=False
    )
    base.update(kw)
    return StreamConfig(**base)


def inputs(seed: int, sizes: list[int]) -> list[list[np.ndarray]]:
    return random_turns(seed, sizes, L, H)


run = run_turns


@pytest.mark.parametrize("routing", ["softmax_topk", "topk_softmax"])
@pytest.mark.parametrize(("mode", "strength"), [("scale", 30.0), ("prune", 0.2)])
@pytest.mark.parametrize("split", [False, True])
def test_selection_stats_and_output_match_numpy(
    make_pack: PackFactory, routing: str, mode: str, strength: float, split: bool
) -> None:
    path = make_pack(
        n_layers=L, n_experts=E, top_k=K, hidden=H, moe_intermediate=INTER, routing=routing
    )
    cfg = config(path, 9 * K, moce=mode, moce_strength=strength, split_turn=split)
    turns = inputs(7, [6, 1, 1, 3, 1, 2, 1])
    changed_total = 0
    partial = 0
    with (
        ExpertStream(path, cfg) as stream,
        Window(stream) as window,
        ExpertPack.open(path) as pack,
    ):
        for xs in turns:
            with window.turn():
                for layer, x in enumerate(xs):
                    before = window.stats()["layers"][layer]
                    got = window.moe(layer, x)
                    after = window.stats()["layers"][layer]
                    seen = window.route_residency()
                    assert seen is not None and seen[0] == layer
                    resident = seen[1]
                    assert resident.shape == (E,)
                    partial += bool(0 < resident.sum() < E)
                    router = pack.router_weights(layer)
                    ids, moved, changed = moce_reference(
                        x, router, K, resident, mode, strength, cfg.moce_keep_top
                    )
                    want = moe_reference_selected(
                        x,
                        router,
                        lambda e, layer=layer: pack.expert_weights(layer, e),
                        ids,
                        routing,
                        True,
                    )
                    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
                    assert after["moce_changed"] - before["moce_changed"] == changed.sum()
                    np.testing.assert_allclose(
                        after["moce_moved_mass"] - before["moce_moved_mass"],
                        moved.sum(),
                        rtol=1e-4,
                        atol=1e-6,
                    )
                    changed_total += int(changed.sum())
        total = window.stats()["total"]
    assert total["moce_changed"] == changed_total
    # The run exercised what it checks: residency was partial and selections did change.
    assert partial > 0
    assert changed_total > 0


@pytest.fixture(scope="module")
def pack(make_pack: PackFactory) -> Path:
    return make_pack(n_layers=L, n_experts=E, top_k=K, hidden=H, moe_intermediate=INTER)


@pytest.mark.parametrize("mode", ["scale", "prune"])
def test_keeping_the_whole_top_k_is_bitwise_exact_routing(pack: Path, mode: str) -> None:
    # keep_top = top_k leaves moce nothing to change: ids and weights must come out of the
    # moce path bitwise as from exact routing (the weights are the model's own rule over the
    # selection, computed the same way), and nothing is reported moved.
    turns = inputs(3, [5, 1, 2, 1])
    exact = run(pack, config(pack, 2 * K + 1), turns)
    cfg = config(pack, 2 * K + 1, moce=mode, moce_strength=1e6, moce_keep_top=K)
    with ExpertStream(pack, cfg) as stream, Window(stream) as window:
        got = []
        for xs in turns:
            with window.turn():
                got.extend(window.moe(layer, x) for layer, x in enumerate(xs))
        total = window.stats()["total"]
    for a, b in zip(got, exact, strict=True):
        np.testing.assert_array_equal(a, b)
    assert total["moce_changed"] == 0
    assert total["moce_moved_mass"] == 0.0


def test_off_reads_no_residency_and_reports_nothing(pack: Path) -> None:
    with ExpertStream(pack, config(pack, 2 * K + 1)) as stream, Window(stream) as window:
        for layer, x in enumerate(inputs(4, [3])[0]):
            window.moe(layer, x)
        total = window.stats()["total"]
        assert window.route_residency() is None
        assert not window._w.settles
    assert total["moce_changed"] == 0
    assert total["moce_moved_mass"] == 0.0


def test_keep_top_above_top_k_is_a_config_error(pack: Path) -> None:
    cfg = config(pack, 2 * K + 1, moce="scale", moce_keep_top=K + 1)
    with ExpertStream(pack, cfg) as stream, pytest.raises(ConfigError, match="moce_keep_top"):
        Window(stream)


def timed_run(
    path: Path, cfg: StreamConfig, turns: list[list[np.ndarray]], delay_seed: int | None
) -> tuple[list[np.ndarray], list[int]]:
    """Outputs and per-layer replaced choices; with delay_seed, half the records (picked by the
    seed) read slowly, which reorders when speculative reads finish against the host points."""
    out = []
    with ExpertStream(path, cfg) as stream, Window(stream) as window:
        assert window._w.settles
        if delay_seed is not None:
            rng = np.random.default_rng(delay_seed)
            for layer in range(L):
                for e in rng.choice(E, E // 2, replace=False):
                    testing.inject_fault(
                        stream, layer, int(e), kind="delay", delay_s=0.004, count=1000
                    )
        for xs in turns:
            with window.turn():
                out.extend(window.moe(layer, x) for layer, x in enumerate(xs))
        changed = [d["moce_changed"] for d in window.stats()["layers"]]
    return out, changed


@pytest.mark.parametrize(("mode", "strength"), [("scale", 30.0), ("prune", 0.2)])
def test_without_publish_prefetch_moce_routing_is_deterministic(
    pack: Path, mode: str, strength: float
) -> None:
    # PUBLISH_PREFETCH=0, one-piece submissions: the host settles IO before the host points, so
    # residency (and with it moce routing) cannot depend on when reads finish. Runs with the
    # same inputs but different IO timing must agree bitwise.
    cfg = config(
        pack,
        2 * E,
        moce=mode,
        moce_strength=strength,
        publish_prefetch=False,
        two_layer_decode=True,
        two_layer_prompt=True,
        max_rows=4,
    )
    turns = inputs(11, [9, 1, 1, 1, 6, 1, 1])
    base, base_changed = timed_run(pack, cfg, turns, None)
    assert sum(base_changed) > 0  # routing did depend on residency
    for seed in (1, 2):
        got, changed = timed_run(pack, cfg, turns, seed)
        assert changed == base_changed
        for a, b in zip(got, base, strict=True):
            np.testing.assert_array_equal(a, b)


def test_moce_determinism_holds_past_the_governors_trial_point(pack: Path) -> None:
    """With settled IO the prefetch governor is timing-free (no wall-time trials, contention
    assumed), so its cap, and with it what is evicted and what moce sees, is a function of the
    call history. Enough decode tokens run for trials to have happened several times over
    (the first after 8 tokens of 4 layers, each lasting 4 tokens), under IO timing perturbed
    differently in each run; outputs must agree bitwise."""
    cfg = config(
        pack,
        4 * K,  # a quarter of the experts: large enough that prefetch changes what moce sees
        moce="scale",
        moce_strength=30.0,
        publish_prefetch=False,
        split_turn=False,
        prefetch_backoff=True,
        lookahead=True,
        two_layer_decode=True,
        max_rows=4,
    )
    # Every layer of a token sees the same input, so router l+1 applied at layer l predicts
    # exactly: prefetch pays, the governor stays open and would run its wall-time trials.
    turns = [[xs[0]] * L for xs in inputs(5, [6] + [1] * 64)]

    def one(delays: int | None) -> tuple[list[np.ndarray], dict[str, Any]]:
        out = []
        with ExpertStream(pack, cfg) as stream, Window(stream) as window:
            assert window._w.settles
            if delays is not None:  # every record slow, by an amount of this run's own
                rng = np.random.default_rng(delays)
                for layer in range(L):
                    for e in range(E):
                        ms = float(rng.choice([0.0, 1.0, 8.0, 20.0]))
                        testing.inject_fault(
                            stream, layer, e, kind="delay", delay_s=ms / 1000, count=1000
                        )
            for xs in turns:
                with window.turn():
                    out.extend(window.moe(layer, x) for layer, x in enumerate(xs))
            stats = window.stats()
        return out, stats

    base, stats = one(None)
    prefetch = stats["prefetch"]
    assert prefetch["deterministic"] is True and prefetch["trials"] == 0
    assert prefetch["epochs"] > 0  # the governor judged (and so could have moved the cap)
    assert sum(d["moce_changed"] for d in stats["layers"]) > 0  # routing read residency
    for seed in (1, 2, 3):
        got, st = one(seed)
        for a, b in zip(got, base, strict=True):
            np.testing.assert_array_equal(a, b)
        assert st["prefetch"]["state"] == prefetch["state"]
        assert st["prefetch"]["cap"] == prefetch["cap"]
