"""The expert profile beside a pack is saved atomically by each writer on its own temporary:
two Windows on one stream, closed from two threads at once, both save without a warning."""

from __future__ import annotations

import threading
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import PackFactory
from strata_stream import ExpertPack, ExpertStream, StreamConfig, Window
from strata_stream import window as window_mod


def test_two_windows_closed_at_once_both_save_the_profile(
    make_pack: PackFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "p.strpk"
    path.write_bytes(make_pack().read_bytes())  # a pack of its own: the profile lands beside it
    with ExpertPack.open(path) as p:
        n = p.geometry.n_layers * p.geometry.n_experts
        cfg = StreamConfig(arena_bytes=n * p.record_stride, io_threads=1, direct_io=False,
                           persist_profile=True)  # fmt: skip
    # Both writers have written their temporary before either renames it: the interleaving
    # that made one rename find its temporary gone when they shared one name.
    both_written = threading.Barrier(2, timeout=30)
    real_save = np.save

    def save(f: Any, arr: Any, *args: Any, **kwargs: Any) -> None:
        real_save(f, arr, *args, **kwargs)
        if threading.current_thread() is not threading.main_thread():
            both_written.wait()

    monkeypatch.setattr("strata_stream.window.np.save", save)
    x = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
    with ExpertStream(path, cfg) as stream:
        windows = [Window(stream), Window(stream)]
        for w in windows:
            for layer in range(stream.n_layers):
                w.moe(layer, x)
        # Recorded here: the warnings filters are the process's, not a thread's.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            threads = [threading.Thread(target=w.close) for w in windows]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
    assert [str(w.message) for w in caught] == []
    assert window_mod.profile_path(path).exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
