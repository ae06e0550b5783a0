"""The server over a model whose experts stream through strata_stream.mlx_lm, not a plain one:
the same greedy text as plain mlx-lm, and the engine's figures in /metrics."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from serve.harness import load_streamed, quarter_arena, serving
from serve.helpers import MODEL_ID, client_for, scrape, wait_until
from strata_stream.convert import convert
from strata_stream.mlx_lm import stats_source
from strata_stream.pack.reader import ExpertPack
from strata_stream.serve import ServeConfig
from strata_stream.serve.loader import load_for_serving


def _metric(samples: dict[str, float], name: str) -> float:
    """A sample by name, counters with Prometheus' _total suffix; -1 while it is not there."""
    for k, v in samples.items():
        if k.split("{")[0] in (name, name + "_total"):
            return v
    return -1.0


def test_a_streamed_model_serves_mlx_lm_greedy_text_and_engine_metrics(
    tiny_path: Path, tiny_pack: Path, tokenizer: Any, oracle: Callable[[list[int], int], str]
) -> None:
    with ExpertPack.open(tiny_pack) as p:
        stride = p.record_stride
    arena = quarter_arena(tiny_pack)
    # experts="mlx": MLX's own kernels over the arena, bitwise plain mlx-lm, so the served text
    # must equal the oracle's exactly.
    model, tok = load_streamed(tiny_path, tiny_pack, arena_bytes=arena, experts="mlx")
    config = ServeConfig(model_id=MODEL_ID, stats_interval_s=0.05)
    with serving(model, tok, config, stats=stats_source(model), close_engine=True) as server:
        client = client_for(server.url)
        msgs: Any = [{"role": "user", "content": "hello world how are you"}]
        r = client.chat.completions.create(
            model=MODEL_ID, messages=msgs, max_tokens=16, temperature=0
        )
        ids = [int(t) for t in tokenizer.apply_chat_template(msgs, add_generation_prompt=True)]
        assert r.choices[0].message.content == oracle(ids, 16)
        # The engine's figures reach /metrics at the next stats sample (every 0.05 s).
        wait_until(
            lambda: _metric(scrape(server.url), "strata_expert_misses") > 0,
            "the engine's misses in /metrics",
        )
        samples = scrape(server.url)
    assert _metric(samples, "strata_expert_misses") > 0  # a quarter arena had to read
    assert _metric(samples, "strata_expert_hits") >= 0
    assert _metric(samples, "strata_expert_hits") + _metric(samples, "strata_expert_misses") > 0
    assert _metric(samples, "strata_expert_bytes_read") >= stride
    assert _metric(samples, "strata_arena_slots") == arena // stride
    assert 0 < _metric(samples, "strata_arena_slots_in_use") <= arena // stride


def test_a_model_loaded_on_one_thread_generates_on_the_servers_worker(
    tiny_path: Path, tokenizer: Any, tmp_path: Path
) -> None:
    """The CPU expert path, loaded here and run by the server's worker thread: every weight
    the model needs is evaluated at load, on the loading thread (MLX cannot evaluate on one
    thread an array made on another's stream). The served text is the model's own greedy text."""
    import mlx_lm

    model, tok = load_streamed(tiny_path, tmp_path / "experts.strpk", experts="cpu")
    msgs: Any = [{"role": "user", "content": "the water is hot"}]
    try:
        with serving(model, tok, stats=stats_source(model)) as server:
            r = client_for(server.url).chat.completions.create(
                model=MODEL_ID, messages=msgs, max_tokens=12, temperature=0
            )
        ids = [int(t) for t in tokenizer.apply_chat_template(msgs, add_generation_prompt=True)]
        assert r.choices[0].message.content == mlx_lm.generate(model, tok, ids, max_tokens=12)
    finally:
        model.strata_engine.close()


def test_the_loader_streams_and_reports_the_engine(
    tiny_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STRATA_CACHE", str(tmp_path))  # the first load converts into the cache
    loaded = load_for_serving(str(tiny_path), arena_bytes=None)
    try:
        assert loaded.stats()["slots_total"] > 0
    finally:
        loaded.model.strata_engine.close()


def test_the_loader_uses_the_pack_it_is_given(tiny_path: Path, tmp_path: Path) -> None:
    """`serve --pack`: the pack `convert -o` wrote, not a conversion into the cache."""
    pack = convert(tiny_path, tmp_path / "tiny.strpk", progress=False)
    loaded = load_for_serving(str(tiny_path), pack_path=pack)
    try:
        assert loaded.model.strata_pack_path == pack
    finally:
        loaded.model.strata_engine.close()
