"""The server's parts on their own: stop strings, the Window stats mapping, config, CLI."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from strata_stream import ExpertStream, StreamConfig, Window
from strata_stream.errors import ConfigError
from strata_stream.pack import ExpertPack
from strata_stream.serve import ServeConfig, window_stats_source
from strata_stream.serve.stop import StopMatcher


def run_stops(stops: list[str], segments: list[str]) -> tuple[str, bool, list[str]]:
    m = StopMatcher(stops)
    sent: list[str] = []
    for seg in segments:
        out, hit = m.feed(seg)
        sent.append(out)
        if hit:
            return "".join(sent), True, sent
    sent.append(m.flush())
    return "".join(sent), False, sent


def test_stop_string_split_across_segments_is_never_sent() -> None:
    text, hit, sent = run_stops(["END"], ["ab", "cE", "N", "Dxyz"])
    assert (text, hit) == ("abc", True)
    assert all("E" not in s for s in sent)  # the held-back prefix never left the server


def test_streamed_text_is_what_a_whole_text_search_gives() -> None:
    """Streamed in random segments, the text sent is what plain str.find gives (an independent
    definition): after the first segment that completes a stop string, the text before the
    earliest stop string it holds; the whole text when none completes."""
    import itertools
    import random

    rng = random.Random(0)
    for _ in range(3000):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 5)))
                 for _ in range(rng.randint(1, 3))]  # fmt: skip
        whole = "".join(rng.choice("abc") for _ in range(rng.randint(0, 30)))
        cuts = sorted(rng.sample(range(len(whole) + 1), min(len(whole) + 1, rng.randint(1, 6))))
        segments = [whole[a:b] for a, b in zip([0, *cuts], [*cuts, len(whole)], strict=True)]
        want = (whole, False)
        for end in itertools.accumulate(len(seg) for seg in segments):
            found = [i for i in (whole[:end].find(s) for s in stops) if i >= 0]
            if found:
                want = (whole[: min(found)], True)
                break
        assert run_stops(stops, segments)[:2] == want


def test_false_stop_prefix_is_released() -> None:
    text, hit, sent = run_stops(["END"], ["abE", "Nx", "y"])
    assert (text, hit) == ("abENxy", False)
    assert sent[0] == "ab"  # "E" held until it could no longer start "END"


def test_earliest_of_several_stops_wins() -> None:
    assert run_stops(["zz", "b c"], ["a b", " c zz"])[:2] == ("a ", True)
    assert run_stops([], ["a", "b"])[:2] == ("ab", False)


@pytest.mark.parametrize(
    "kw",
    [
        {"model_id": ""},
        {"model_id": "m", "max_queue": 0},
        {"model_id": "m", "context_length": 1},
        {"model_id": "m", "default_max_tokens": 0},
        {"model_id": "m", "stats_interval_s": 0},
    ],
)
def test_bad_serve_config_raises(kw: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        ServeConfig(**kw)  # type: ignore[arg-type]


def test_window_stats_source_maps_the_engine_figures(make_pack) -> None:  # type: ignore[no-untyped-def]
    path: Path = make_pack()
    with ExpertPack.open(path) as p:
        g, stride = p.geometry, p.record_stride
    n_slots = 2 * g.top_k * 2
    cfg = StreamConfig(
        arena_bytes=n_slots * stride, io_threads=2, direct_io=False, persist_profile=False
    )
    rng = np.random.default_rng(0)
    with ExpertStream(path, cfg) as stream, Window(stream) as w:
        with w.turn():
            for layer in range(g.n_layers):
                w.moe(layer, rng.standard_normal((16, g.hidden)).astype(np.float32))
        snap = window_stats_source(w)()
        st = w.stats()
        states = stream.slot_table()["state"]
    total = st["total"]
    assert snap["hits"] == total["hits"] and snap["misses"] == total["misses"]
    assert snap["hits"] + snap["misses"] > 0 and snap["bytes_read"] == total["bytes_read"] > 0
    assert snap["stall_s"] == total["stall_seconds"]
    assert snap["slots_total"] == n_slots
    assert snap["slots_in_use"] == sum(1 for s in states if s != 0) > 0
    assert (snap["pred_correct"], snap["pred_predicted"], snap["pred_actual"]) == (
        total["pred_correct"],
        total["pred_predicted"],
        total["pred_actual"],
    )
    assert len(snap["per_layer_hit_rate"]) == g.n_layers
    assert snap["routed"] == g.n_layers * 16 * g.top_k  # every row of every call
    for rate, d in zip(snap["per_layer_hit_rate"], st["layers"], strict=True):
        assert rate == d["hits"] / (d["hits"] + d["misses"])


def test_cli_has_serve(capsys: pytest.CaptureFixture[str]) -> None:
    from strata_stream.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    for opt in ("--host", "--port", "--arena-gb", "MODEL"):
        assert opt in out


def test_serve_on_a_port_in_use_fails_before_loading_naming_the_port(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket

    import strata_stream.serve.loader as loader
    from strata_stream.cli import main

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded before the port was bound")

    monkeypatch.setattr(loader, "load_for_serving", never)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(["serve", str(tmp_path), "--port", str(port)])
    err = capsys.readouterr().err
    assert code == 2
    assert f"127.0.0.1:{port}" in err and "Traceback" not in err


def test_each_engine_gets_its_batch_and_both_take_the_workers_arguments() -> None:
    """The worker builds whichever batch its engine names through one constructor shape
    (serve/engine_batch.py): both classes take exactly BatchFactory's parameters."""
    import inspect

    pytest.importorskip("mlx_lm")
    pytest.importorskip("torch")
    from strata_stream.serve.batch import ContinuousBatch
    from strata_stream.serve.engine_batch import BatchFactory, batch_factory
    from strata_stream.serve.transformers_continuous import TransformersBatch

    assert batch_factory("mlx-lm") is ContinuousBatch
    assert batch_factory("transformers") is TransformersBatch

    def shape(f: object) -> list[tuple[str, object]]:
        params = inspect.signature(f).parameters.values()  # type: ignore[arg-type]
        return [(p.name, p.kind) for p in params if p.name != "self"]

    want = shape(BatchFactory.__call__)
    assert shape(ContinuousBatch.__init__) == want
    assert shape(TransformersBatch.__init__) == want
