"""Shared fixtures: small real packs written with the public writer."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from strata_stream import ExpertStream, StreamConfig, Window
from strata_stream.pack import Geometry, write_pack

PackFactory = Callable[..., Path]


def random_experts(geometry: Geometry, seed: int) -> Callable[[int, int], tuple[np.ndarray, ...]]:
    def experts(layer: int, expert: int) -> tuple[np.ndarray, ...]:
        rng = np.random.default_rng((seed, layer, expert))
        i, h = geometry.moe_intermediate, geometry.hidden
        scale = 1.0 / np.sqrt(h)
        return (
            (rng.standard_normal((i, h)) * scale).astype(np.float32),
            (rng.standard_normal((i, h)) * scale).astype(np.float32),
            (rng.standard_normal((h, i)) / np.sqrt(i)).astype(np.float32),
        )

    return experts


def random_routers(geometry: Geometry, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng((seed, 999))
    return [
        rng.standard_normal((geometry.n_experts, geometry.hidden)).astype(np.float32)
        for _ in range(geometry.n_layers)
    ]


@pytest.fixture
def closing() -> Iterator[list[Any]]:
    """Models loaded by strata_stream.mlx_lm or .transformers that a test appends: their engines
    (stream and Window) are closed when it ends, pass or fail."""
    models: list[Any] = []
    yield models
    for m in models:
        m.strata_engine.close()


@pytest.fixture(scope="session")
def make_pack(tmp_path_factory: pytest.TempPathFactory) -> PackFactory:
    """make_pack(n_layers=4, n_experts=16, top_k=2, hidden=64, moe_intermediate=48, fmt='f32')."""
    cache: dict[tuple[object, ...], Path] = {}

    def make(
        n_layers: int = 4,
        n_experts: int = 16,
        top_k: int = 2,
        hidden: int = 64,
        moe_intermediate: int = 48,
        weight_format: str = "f32",
        group_size: int = 64,
        routing: str = "softmax_topk",
        seed: int = 0,
    ) -> Path:
        key = (
            n_layers,
            n_experts,
            top_k,
            hidden,
            moe_intermediate,
            weight_format,
            group_size,
            routing,
            seed,
        )
        if key not in cache:
            g = Geometry(n_layers, n_experts, top_k, hidden, moe_intermediate, routing, True)
            path = tmp_path_factory.mktemp("packs") / f"p{len(cache)}.strpk"
            write_pack(
                path,
                g,
                random_routers(g, seed),
                random_experts(g, seed),
                weight_format=weight_format,
                group_size=group_size,
                scale_dtype="e8m0" if weight_format == "mxfp4" else "f16",
                progress=False,
            )
            cache[key] = path
        return cache[key]

    return make


def record_bytes_of(path: Path, layout: dict[str, int], key: int) -> bytes:
    """A record's payload straight from the file, independent of the engine."""
    with open(path, "rb") as f:
        f.seek(layout["records_offset"] + key * layout["record_stride"])
        return f.read(layout["record_bytes"])


def random_turns(seed: int, sizes: list[int], n_layers: int, hidden: int) -> list[list[np.ndarray]]:
    """Per turn, per layer, an input [T, hidden]: independent of the outputs, so runs compare."""
    rng = np.random.default_rng(seed)
    return [
        [rng.standard_normal((t, hidden)).astype(np.float32) for _ in range(n_layers)]
        for t in sizes
    ]


def run_turns(path: Path, config: StreamConfig, turns: list[list[np.ndarray]]) -> list[np.ndarray]:
    """Every layer of every turn through a fresh stream and Window; the outputs in order."""
    out = []
    with ExpertStream(path, config) as stream, Window(stream) as window:
        for xs in turns:
            with window.turn():
                out.extend(window.moe(layer, x) for layer, x in enumerate(xs))
    return out
