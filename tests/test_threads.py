"""Window and ExpertStream from several Python threads: lifecycle, turn ownership, shared arenas.

Real threads (the engine releases the GIL inside every call). Every loop is bounded, so a
regression fails instead of hanging; nothing asserts on timing. Exactness is the all-resident
run (and, once, the numpy oracle), as in test_window.py (I11).
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import strata_stream
from conftest import PackFactory, random_turns, run_turns
from oracle import moe_reference, route_reference
from strata_stream import ExpertPack, ExpertStream, StreamConfig, Window, testing
from strata_stream.errors import (
    ArenaFullError,
    ConfigError,
    StreamClosedError,
    TurnError,
)

L, E, K, H, INTER = 4, 16, 4, 64, 48
BOUND_S = 60.0  # the longest any test waits for a thread: a hang fails, it does not block


def config(path: Path, n_slots: int | None = None, **kw: object) -> StreamConfig:
    with ExpertPack.open(path) as p:
        stride = p.record_stride
    n = n_slots if n_slots is not None else L * E
    base: dict[str, object] = dict(
        arena_bytes=n * stride, io_threads=2, direct_io=False, persist_profile=False
    )
    base.update(kw)
    return StreamConfig(**base)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def pack(make_pack: PackFactory) -> Path:
    return make_pack(n_layers=L, n_experts=E, top_k=K, hidden=H, moe_intermediate=INTER)


class Worker(threading.Thread):
    """Runs fn on its own thread; join() re-raises what it raised, and fails on a hang."""

    def __init__(self, fn: Callable[[], object]) -> None:
        super().__init__(daemon=True)
        self.fn = fn
        self.result: object = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as err:  # handed to the main thread
            self.error = err

    def finish(self) -> object:
        self.join(BOUND_S)
        assert not self.is_alive(), "a worker thread hung"
        if self.error is not None:
            raise self.error
        return self.result


def wait_until(cond: Callable[[], bool], what: str) -> None:
    stop = threading.Event()
    for _ in range(int(BOUND_S / 0.002)):
        if cond():
            return
        stop.wait(0.002)
    raise AssertionError(f"never happened: {what}")


def routed(path: Path, layer: int, x: np.ndarray) -> set[int]:
    with ExpertPack.open(path) as p:
        ids, _ = route_reference(x, p.router_weights(layer), K, "softmax_topk", True)
    return {int(e) for e in ids.ravel()}


def run_window(window: Window, turns: list[list[np.ndarray]]) -> list[np.ndarray]:
    out = []
    for xs in turns:
        with window.turn():
            out.extend(window.moe(layer, x) for layer, x in enumerate(xs))
    return out


# ---- several Windows on one stream ------------------------------------------------------------


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("n_slots", [4 * K, 6 * K])
def test_two_windows_on_two_threads_stay_bitwise_exact(
    pack: Path, split: bool, n_slots: int
) -> None:
    """Each Window's output equals the all-resident run while another Window competes for the
    same small arena from another thread (prompts in waves, decode, predictions on)."""
    sizes = [[9, 1, 1, 2], [1, 1, 6, 1]]
    seqs = [random_turns(100 + i, sizes[i], L, H) for i in range(2)]
    want = [run_turns(pack, config(pack, lookahead=False), s) for s in seqs]
    cfg = config(pack, n_slots, split_turn=split, max_rows=4, io_threads=3, io_timeout_s=30.0)
    for _ in range(6):  # repeated: interleavings differ from round to round
        with ExpertStream(pack, cfg) as stream:
            windows = [Window(stream, threads=1) for _ in range(2)]
            workers = [
                Worker(lambda w=w, s=s: run_window(w, s))
                for w, s in zip(windows, seqs, strict=True)
            ]
            for t in workers:
                t.start()
            got = [t.finish() for t in workers]
            assert testing.check_invariants(stream) == ""
            for w in windows:
                w.close()
        for g, w_ in zip(got, want, strict=True):
            assert isinstance(g, list) and len(g) == len(w_)
            assert all(np.array_equal(a, b) for a, b in zip(g, w_, strict=True))


def test_two_windows_agree_with_the_numpy_oracle(pack: Path) -> None:
    seqs = [random_turns(200 + i, [3, 1], L, H) for i in range(2)]
    with ExpertStream(pack, config(pack, 3 * K, io_timeout_s=30.0)) as stream:
        windows = [Window(stream, threads=1) for _ in range(2)]
        workers = [
            Worker(lambda w=w, s=s: run_window(w, s)) for w, s in zip(windows, seqs, strict=True)
        ]
        for t in workers:
            t.start()
        got = [t.finish() for t in workers]
    with ExpertPack.open(pack) as p:
        for outs, seq in zip(got, seqs, strict=True):
            assert isinstance(outs, list)
            flat = [x for xs in seq for x in xs]
            for i, x in enumerate(flat):
                layer = i % L
                want = moe_reference(
                    x,
                    p.router_weights(layer),
                    lambda e, layer=layer: p.expert_weights(layer, e),
                    K,
                    "softmax_topk",
                    True,
                )
                np.testing.assert_allclose(outs[i], want, rtol=1e-4, atol=1e-5)


def disjoint_inputs(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Two one-token inputs whose layer-0 experts share nothing."""
    rng = np.random.default_rng(5)
    a = rng.standard_normal((1, H)).astype(np.float32)
    for _ in range(1000):
        b = rng.standard_normal((1, H)).astype(np.float32)
        if not routed(path, 0, a) & routed(path, 0, b):
            return a, b
    raise AssertionError("no disjoint routing found")


def test_windows_whose_protections_fill_the_arena_raise_arena_full(pack: Path) -> None:
    xa, xb = disjoint_inputs(pack)
    want_b = run_turns(pack, config(pack, lookahead=False), [[xb] * L])
    cfg = config(pack, 2 * K, io_timeout_s=0.5)
    with ExpertStream(pack, cfg) as stream, Window(stream) as wa, Window(stream) as wb:
        with wa.turn():
            wa.moe(0, xa)  # wa now protects layer 0's experts and all of layer 1's: 2k slots
            with pytest.raises(ArenaFullError, match="another window"):
                wb.moe(0, xb)
        assert testing.check_invariants(stream) == ""
        with wb.turn():  # wa's turn ended: wb has the arena
            got = [wb.moe(layer, xb) for layer in range(L)]
    assert all(np.array_equal(a, b) for a, b in zip(got, want_b, strict=True))


def test_a_window_waits_for_another_to_move_on(pack: Path) -> None:
    xa, xb = disjoint_inputs(pack)
    want_b = run_turns(pack, config(pack, lookahead=False), [[xb] * L])
    cfg = config(pack, 2 * K, io_timeout_s=BOUND_S)
    with ExpertStream(pack, cfg) as stream, Window(stream) as wa, Window(stream) as wb:
        with wa.turn():
            wa.moe(0, xa)
            other = Worker(lambda: run_window(wb, [[xb] * L]))
            other.start()
            wait_until(
                lambda: testing.clients_waiting_for_space(stream) == 1, "wb waits for a slot"
            )
        got = other.finish()  # wa's turn ended: its protections went, wb proceeds
    assert isinstance(got, list)
    assert all(np.array_equal(a, b) for a, b in zip(got, want_b, strict=True))


# ---- turns belong to threads ------------------------------------------------------------------


def test_a_turn_belongs_to_the_thread_that_opened_it(pack: Path) -> None:
    xs = random_turns(3, [2], L, H)[0]
    want = run_turns(pack, config(pack), [xs])
    with ExpertStream(pack, config(pack, 3 * K)) as stream, Window(stream) as w:
        with w.turn():
            got = [w.moe(0, xs[0])]
            for attempt in (
                lambda: w.moe(1, xs[1]),
                lambda: w._w.end_turn(),
                lambda: w._w.begin_turn(),
                lambda: w.turn().__enter__(),
            ):
                t = Worker(attempt)
                t.start()
                with pytest.raises(TurnError, match="another thread"):
                    t.finish()
            got += [w.moe(layer, x) for layer, x in enumerate(xs) if layer > 0]
        assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
        # With the turn over, another thread may open its own.
        t = Worker(lambda: w.moe(0, xs[0]))
        t.start()
        assert np.array_equal(t.finish(), want[0])  # type: ignore[arg-type]
        with pytest.raises(TurnError, match="another thread"):
            w.moe(1, xs[1])  # the implicit turn that thread opened is its own


# ---- close and lifecycle ----------------------------------------------------------------------


@pytest.mark.parametrize("split", [False, True])
def test_close_from_another_thread_waits_for_the_layer_in_flight(pack: Path, split: bool) -> None:
    xs = random_turns(4, [1], L, H)[0]
    want = run_turns(pack, config(pack), [xs])
    slow = sorted(routed(pack, 1, xs[1]))[0]
    cfg = config(pack, 2 * K, split_turn=split, lookahead=False)
    for _ in range(3):
        with ExpertStream(pack, cfg) as stream:
            w = Window(stream)
            testing.inject_fault(stream, 1, slow, kind="delay", delay_s=0.2, count=-1)
            entered = threading.Event()
            outputs: list[np.ndarray] = []

            def turns(
                w: Window = w,
                entered: threading.Event = entered,
                outputs: list[np.ndarray] = outputs,
            ) -> None:
                for _ in range(1000):  # until close() fails a turn
                    with w.turn():
                        for layer, x in enumerate(xs):
                            entered.set()
                            outputs.append(w.moe(layer, x))

            t = Worker(turns)
            t.start()
            entered.wait(BOUND_S)
            w.close()
            with pytest.raises(StreamClosedError, match="Window is closed"):
                t.finish()
            # Every layer that returned is exact: the one in flight finished before close().
            assert all(np.array_equal(o, want[i % L]) for i, o in enumerate(outputs))
            assert w.stats()["scratch_bytes"] == 0
            assert testing.check_invariants(stream) == ""
            testing.clear_faults(stream)
            with Window(stream) as again:  # the stream stays usable
                assert all(
                    np.array_equal(a, b) for a, b in zip(run_window(again, [xs]), want, strict=True)
                )


def test_closing_the_stream_closes_its_windows_first(pack: Path, tmp_path: Path) -> None:
    xs = random_turns(6, [1], L, H)[0]
    trace = tmp_path / "t.trace"
    cfg = config(pack, 4 * K, trace_path=str(trace))
    stream = ExpertStream(pack, cfg)
    busy, idle = Window(stream), Window(stream)
    entered = threading.Event()

    def turns() -> None:
        for _ in range(100_000):
            entered.set()
            for layer, x in enumerate(xs):
                busy.moe(layer, x)

    t = Worker(turns)
    t.start()
    entered.wait(BOUND_S)
    stream.close()
    with pytest.raises(StreamClosedError):
        t.finish()
    assert busy.closed and idle.closed and stream.closed
    with pytest.raises(StreamClosedError):
        idle.moe(0, xs[0])
    with pytest.raises(StreamClosedError):
        Window(stream)
    assert trace.read_text().startswith("#")  # the trace was written out and closed


def test_concurrent_closes_are_safe(pack: Path) -> None:
    xs = random_turns(7, [1], L, H)[0]
    for _ in range(5):
        stream = ExpertStream(pack, config(pack, 3 * K))
        windows = [Window(stream, threads=1) for _ in range(2)]
        first = windows[0]
        runner = Worker(lambda first=first: [run_window(first, [xs]) for _ in range(3)])
        closers = [Worker(w.close) for w in windows] + [Worker(stream.close) for _ in range(3)]
        runner.start()
        for c in closers:
            c.start()
        for c in closers:
            c.finish()
        with contextlib.suppress(StreamClosedError):
            runner.finish()
        assert stream.closed and all(w.closed for w in windows)
        assert stream._s.closed


def live_threads() -> dict[int, str]:
    """The process's threads, kernel id to name. Compared by id, not counted: another test's
    stream being collected may start or end a thread of its own while this test runs."""
    live = {}
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ends while we look
            live[int(task.name)] = (task / "comm").read_text().strip()
    return live


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs /proc (Linux)")
def test_close_frees_the_device_thread_pool_and_scratch_at_once(pack: Path) -> None:
    xs = random_turns(8, [20], L, H)[0]
    with ExpertStream(pack, config(pack, prompt_buf_reuse=True)) as stream:
        before = live_threads()
        w = Window(stream, threads=3)  # a device thread and two pool workers
        want = ["strata-device", "strata-pool", "strata-pool"]

        def started() -> dict[int, str]:  # a thread names itself once it runs
            return {t: n for t, n in live_threads().items() if t not in before and n in want}

        wait_until(lambda: sorted(started().values()) == want, "the Window's threads started")
        ours = started()
        with w.turn():
            for layer, x in enumerate(xs):
                w.moe(layer, x)
        assert w.stats()["scratch_bytes"] > 0
        w.close()  # not at garbage collection: w is still referenced here
        assert not (ours.keys() & live_threads().keys())
        assert w.stats()["scratch_bytes"] == 0
        assert w.stats()["total"]["calls"] == L  # figures stay readable
        assert testing.n_clients(stream) == 1  # left at destruction, its protections already gone


def test_a_destroyed_window_ends_its_turn_on_the_stream(pack: Path) -> None:
    xa, xb = disjoint_inputs(pack)
    want_b = run_turns(pack, config(pack, lookahead=False), [[xb] * L])
    with ExpertStream(pack, config(pack, 2 * K, io_timeout_s=0.5)) as stream:
        wa = Window(stream)
        wa._w.begin_turn()
        wa.moe(0, xa)  # holds the whole minimum arena
        del wa
        gc.collect()
        assert testing.n_clients(stream) == 0
        with Window(stream) as wb:
            got = run_window(wb, [[xb] * L])
    assert all(np.array_equal(a, b) for a, b in zip(got, want_b, strict=True))


def test_a_stuck_read_does_not_hang_close(pack: Path) -> None:
    from strata_stream import _core as core

    streams = [ExpertStream(pack, config(pack, io_timeout_s=0.3, io_threads=1))]
    s = streams[0]
    testing.inject_fault(s, 0, 3, kind="delay", delay_s=2.0)
    testing.request(s, 0, [3])
    wait_until(
        lambda s=s: int(s.slot_table()["parts_started"][testing.where(s, 0, 3) or 0]) > 0,
        "the read started",
    )
    with pytest.warns(RuntimeWarning, match="layer 0 expert 3"):
        s.close()  # bounded by io_timeout_s, not by the stuck read
    assert s.closed
    with pytest.raises(StreamClosedError):
        testing.request(s, 0, [4])
    del s
    streams.clear()
    gc.collect()  # the read still runs: the stream is freed by a background thread
    wait_until(lambda: core.disposing() == 0, "the stuck stream was freed")


# ---- the extension validates its own arguments ------------------------------------------------


def test_core_window_moe_checks_its_array(pack: Path) -> None:
    with ExpertStream(pack, config(pack)) as stream, Window(stream) as w:
        core_w = w._w
        good = np.zeros((2, H), np.float32)
        with pytest.raises(ValueError, match="2-D"):
            core_w.moe(0, np.zeros(H, np.float32))
        with pytest.raises(ValueError, match=r"shape \[rows, 64\]"):
            core_w.moe(0, np.zeros((2, H - 1), np.float32))
        with pytest.raises(TypeError, match="float32"):
            core_w.moe(0, good.astype(np.float64))
        with pytest.raises(TypeError, match="float32"):
            core_w.moe(0, good.astype(np.int32))
        with pytest.raises(ValueError, match="C-contiguous"):
            core_w.moe(0, np.zeros((H, 2), np.float32).T)
        with pytest.raises(IndexError, match="out of range"):
            core_w.moe(L, good)
        with pytest.raises(TypeError):
            core_w.moe(-1, good)
        with pytest.raises(TurnError, match="starts at layer 0"):
            core_w.moe(1, good)
        assert core_w.moe(0, good).shape == (2, H)  # and a good call still works
        with pytest.raises(ValueError, match="profile"):
            core_w.set_profile(np.zeros(3, np.uint32))
        with pytest.raises(TypeError, match="integers"):
            core_w.set_profile(np.zeros((L, E), np.float32))
        with pytest.raises(ValueError, match="out of range"):
            core_w.set_profile(np.full((L, E), -1, np.int64))


def test_core_stream_checks_its_arguments(pack: Path) -> None:
    from strata_stream import _core as core

    with ExpertStream(pack, config(pack, io_threads=0)) as stream:
        s = stream._s
        hooks = core.testing
        urgent = core.ReadClass.URGENT
        with pytest.raises(TypeError, match="integers"):
            hooks.request(s, 0, np.array([1.7]), urgent)  # was silently cast to expert 1
        with pytest.raises(ValueError, match="1-D"):
            hooks.request(s, 0, np.zeros((2, 2), np.int32), urgent)
        with pytest.raises(IndexError, match="out of range"):
            hooks.request(s, 0, np.array([2**40]), urgent)  # was wrapped to a valid id
        with pytest.raises(IndexError, match="out of range"):
            hooks.request(s, 0, [-1], urgent)
        with pytest.raises(IndexError, match="out of range"):
            hooks.request(s, 0, [E], urgent)
        with pytest.raises(TypeError):
            hooks.request(s, 0, [1], 0)  # a ReadClass, not an int
        with pytest.raises(TypeError, match="integers"):
            hooks.plan(s, 0, np.array([0.5]))
        with pytest.raises(IndexError, match=rf"expert {E} out of range \[0, {E}\)"):
            hooks.inject_fault(s, layer=0, expert=E)
        with pytest.raises(IndexError, match=rf"layer -1 out of range \[0, {L}\)"):
            hooks.inject_fault(s, layer=-1, expert=0)
        with pytest.raises(IndexError, match="part"):
            hooks.inject_fault(s, layer=0, expert=0, part=testing.n_parts(stream))
        with pytest.raises(ValueError, match="delay_s"):
            hooks.inject_fault(s, layer=0, expert=0, kind="delay", delay_s=-1.0)
        with pytest.raises(ValueError, match="fault kind"):
            hooks.inject_fault(s, layer=0, expert=0, kind="boom")
        with pytest.raises(TypeError):
            hooks.inject_fault(s, 0, 0)  # keywords only
        assert hooks.request(s, 0, [1, 2], urgent) == (0, 2, 0)
        assert testing.check_invariants(stream) == ""


def test_core_constructors_take_their_options_as_one_object(pack: Path) -> None:
    from strata_stream import _core as core

    c = config(pack)
    with pytest.raises(TypeError):
        core.Stream(str(pack), c.arena_bytes, 2, c.part_bytes, False, False, 5.0, True)
    stream_options = c.stream_options(direct_io=False)
    stream_options.io_timeout_s = float("inf")
    with pytest.raises(ConfigError, match="io_timeout_s"):
        core.Stream(str(pack), stream_options)  # the engine's validate() runs before it opens
    with ExpertStream(pack, c) as stream:
        with pytest.raises(TypeError):
            core.Window(stream._s, core.WindowOptions(), "cpu", 0)  # backend, threads by name
        with pytest.raises(TypeError):
            core.Window(stream._s, split_turn=True)  # options travel as one WindowOptions
        options = core.WindowOptions()
        options.device_timeout_s = float("nan")
        with pytest.raises(ConfigError, match="device_timeout_s"):
            core.Window(stream._s, options)
        options = core.WindowOptions()
        options.max_rows = 0
        with pytest.raises(ConfigError, match="max_rows"):
            core.Window(stream._s, options)
        with pytest.raises(ConfigError, match="max_rows must be 0..4294967295, got -1"):
            options.max_rows = -1
        with pytest.raises(ConfigError, match="moce must be off, scale or prune"):
            options.moce = "sometimes"
        options = core.WindowOptions()
        options.split_turn, options.lookahead = True, False
        w = core.Window(stream._s, options)
        w.close()


def test_enums_and_absent_come_from_the_extension() -> None:
    from enum import IntEnum

    from strata_stream import _core as core
    from strata_stream.stream import ABSENT

    assert strata_stream.ReadClass is core.ReadClass
    assert strata_stream.SlotState is core.SlotState
    assert issubclass(core.ReadClass, IntEnum) and issubclass(core.SlotState, IntEnum)
    assert ABSENT == core.ABSENT == 0xFFFFFFFF
    assert [c.name for c in core.ReadClass] == ["URGENT", "PRED1", "PRED2", "PROFILE"]
    assert not hasattr(StreamConfig(), "extra")
