"""Use after fork(): an ExpertStream or Window inherited by a child process fails at once.

The engine's IO and device threads do not survive fork(), and locks they held stay held in the
child, so any call on an inherited object could wait forever. The wrappers refuse every call in
the child with a StrataError that says what to do, and neither close() nor garbage collection
there touches the native object. A stream opened in the child works.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import PackFactory
from strata_stream import ExpertPack, ExpertStream, StreamConfig, Window
from strata_stream.errors import StrataError

pytestmark = pytest.mark.skipif(
    not hasattr(os, "register_at_fork") or sys.platform == "win32", reason="needs fork()"
)

CHILD_TIMEOUT_S = 60.0


def _config(path: Path) -> StreamConfig:
    with ExpertPack.open(path) as p:
        n = p.geometry.n_layers * p.geometry.n_experts
        return StreamConfig(
            arena_bytes=n * p.record_stride, io_threads=2, direct_io=False, persist_profile=False
        )


def _expect_refused(call: Any, what: str, report: list[str]) -> None:
    try:
        call()
    except StrataError as err:
        if "another process" not in str(err) or "open the pack again" not in str(err):
            report.append(f"{what}: unclear message {err!r}")
        return
    except BaseException as err:  # noqa: BLE001 - any other outcome is the failure reported
        report.append(f"{what}: {type(err).__name__}: {err}")
        return
    report.append(f"{what}: no error")


def _refusals(stream: ExpertStream, window: Window, x: Any, report: list[str]) -> None:
    _expect_refused(lambda: window.moe(0, x), "Window.moe", report)
    _expect_refused(lambda: stream.fill(), "ExpertStream.fill", report)
    _expect_refused(lambda: stream.stats(), "ExpertStream.stats", report)
    _expect_refused(lambda: Window(stream), "Window(inherited stream)", report)
    _expect_refused(lambda: window.stats(), "Window.stats", report)


def _child(path: Path, stream: ExpertStream, window: Window, x: Any, want: Any, out: Path) -> None:
    report: list[str] = []
    _refusals(stream, window, x, report)
    # Neither close() nor garbage collection may wait for threads that do not exist here.
    window.close()
    stream.close()
    repr(stream)
    del stream, window
    gc.collect()
    with ExpertStream(path, _config(path)) as s, Window(s) as w:
        got = np.stack([w.moe(layer, x) for layer in range(s.n_layers)])
        if not np.array_equal(got, want):
            report.append("a stream opened in the child computed another result")
    out.write_text("\n".join(report) if report else "ok")


def test_an_inherited_stream_and_window_refuse_at_once_and_a_new_one_works(
    make_pack: PackFactory, tmp_path: Path
) -> None:
    path = make_pack()
    x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    out = tmp_path / "child.txt"
    with ExpertStream(path, _config(path)) as stream, Window(stream) as window:
        want = np.stack([window.moe(layer, x) for layer in range(stream.n_layers)])
        window.moe(0, x)  # leave a turn open, its IO threads alive, as a server's would be
        ctx = multiprocessing.get_context("fork")
        proc = ctx.Process(target=_child, args=(path, stream, window, x, want, out))
        proc.start()
        proc.join(CHILD_TIMEOUT_S)
        if proc.is_alive():
            proc.kill()
            proc.join()
            pytest.fail(f"the child hung: {out.read_text() if out.exists() else 'no report'}")
        # The parent's objects are untouched by the child.
        for layer in range(1, stream.n_layers):
            window.moe(layer, x)
        assert np.array_equal(window.moe(0, x), want[0])
    assert proc.exitcode == 0
    assert out.read_text() == "ok"
