"""The binding surface: clear errors for every bad argument, each range checked once (by the
engine, whichever way a caller comes in), the test hooks off the product classes, and the
`_core.pyi` stub in step with what the extension binds."""

from __future__ import annotations

import ast
import inspect
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import strata_stream
from conftest import PackFactory
from strata_stream import ExpertStream, StreamConfig, Window, testing
from strata_stream import _core as core
from strata_stream.errors import ConfigError

L, E, K, H = 4, 16, 2, 64


@pytest.fixture
def stream(make_pack: PackFactory) -> Iterator[ExpertStream]:
    path = make_pack(n_layers=L, n_experts=E, top_k=K, hidden=H)
    from strata_stream import ExpertPack

    with ExpertPack.open(path) as p:
        stride = p.record_stride
    cfg = StreamConfig(arena_bytes=8 * stride, io_threads=1, part_bytes=16384, direct_io=False)
    s = ExpertStream(path, cfg)
    yield s
    s.close()


# ---- what used to be raw pybind11 errors ("incompatible function arguments") ---------------


def test_window_threads_out_of_range_names_the_argument(stream: ExpertStream) -> None:
    one_per_core = re.escape("threads must be 0..1024 (0 = one per core), got -3")
    with pytest.raises(ConfigError, match=one_per_core):
        Window(stream, threads=-3)
    with pytest.raises(ConfigError, match=r"threads must be 0\.\.1024 .*, got 1025"):
        Window(stream, threads=1025)
    with pytest.raises(TypeError, match="threads must be an int, got float"):
        Window(stream, threads=1.5)  # type: ignore[arg-type]
    with Window(stream, threads=1) as w:
        assert not w.closed


def test_wants_predictions_rows_are_checked_once_by_the_binding(stream: ExpertStream) -> None:
    with Window(stream) as w:
        with pytest.raises(ConfigError, match=r"rows must be 0\.\.4294967295, got -1"):
            w.wants_predictions(0, -1)
        with pytest.raises(TypeError, match="rows must be an int, got bool"):
            w.wants_predictions(0, True)
        assert w.wants_predictions(0, np.int64(1)) == w.wants_predictions(0, 1)


def test_slot_bytes_out_of_range_names_the_slot(stream: ExpertStream) -> None:
    n = stream.n_slots
    with pytest.raises(IndexError, match=rf"slot -1 out of range \[0, {n}\)"):
        testing.slot_bytes(stream, -1)
    with pytest.raises(IndexError, match=rf"slot {n} out of range \[0, {n}\)"):
        testing.slot_bytes(stream, n)
    with pytest.raises(IndexError, match=rf"slot {2**70} out of range"):
        testing.slot_bytes(stream, 2**70)  # past int64 too
    with pytest.raises(TypeError, match="slot must be an int, got str"):
        testing.slot_bytes(stream, "0")  # type: ignore[arg-type]
    assert testing.slot_bytes(stream, np.int64(n - 1)).size == stream._s.layout["record_bytes"]


def test_cancel_out_of_range_names_layer_or_expert(stream: ExpertStream) -> None:
    with pytest.raises(IndexError, match=rf"expert -1 out of range \[0, {E}\)"):
        testing.cancel(stream, 0, -1)
    with pytest.raises(IndexError, match=rf"expert {E} out of range \[0, {E}\)"):
        testing.cancel(stream, 0, E)
    with pytest.raises(IndexError, match=rf"layer -1 out of range \[0, {L}\)"):
        testing.cancel(stream, -1, 0)
    with pytest.raises(TypeError, match="expert must be an int, got float"):
        testing.cancel(stream, 0, 1.0)  # type: ignore[arg-type]  # was truncated to expert 1
    with pytest.raises(TypeError, match="layer must be an int, got bool"):
        testing.cancel(stream, True, 1)
    assert testing.cancel(stream, 0, 1) is False  # nothing queued: nothing to cancel


def test_window_options_refuse_what_does_not_fit() -> None:
    o = core.WindowOptions()
    with pytest.raises(ConfigError, match=r"max_rows must be 0\.\.4294967295, got -1"):
        o.max_rows = -1
    with pytest.raises(ConfigError, match=r"decode_rows must be 0\.\.4294967295, got 4294967296"):
        o.decode_rows = 2**32
    with pytest.raises(ConfigError, match="moce must be off, scale or prune, got 'maybe'"):
        o.moce = "maybe"
    o.max_rows, o.moce = 7, "prune"
    assert (o.max_rows, o.moce) == (7, "prune")


# ---- one check, one message -------------------------------------------------------------------


def test_expert_ids_are_checked_once_by_the_engine(stream: ExpertStream) -> None:
    """The Python wrapper adds no check of its own: it and _core directly meet the engine's
    one check, with the same message."""
    urgent = core.ReadClass.URGENT
    for bad, what in [(E, f"expert {E} out of range"), (-1, "expert -1 out of range")]:
        with pytest.raises(IndexError, match=what) as via_wrapper:
            testing.request(stream, 0, [bad])
        with pytest.raises(IndexError, match=what) as via_core:
            core.testing.request(stream._s, 0, [bad], urgent)
        assert str(via_wrapper.value) == str(via_core.value) == f"{what} [0, {E})"
    # An id past int32 never reaches the engine: refused where it is converted, in the same
    # words (not wrapped to expert 3).
    with pytest.raises(IndexError, match=rf"expert 4294967299 out of range \[0, {E}\)"):
        testing.wait(stream, 0, [2**32 + 3])
    with pytest.raises(IndexError, match=rf"enter_layer: expert {E} out of range"):
        testing.enter_layer(stream, 0, [1, E])  # the engine would skip it silently: refused here
    assert testing.check_invariants(stream) == ""


def test_max_rows_is_checked_once_by_the_engine(stream: ExpertStream) -> None:
    with pytest.raises(ConfigError, match="max_rows must be positive") as via_config:
        stream.config.replace(max_rows=0)  # StreamConfig asks the engine's validate()
    options = core.WindowOptions()
    options.max_rows = 0
    with pytest.raises(ConfigError, match="max_rows must be positive") as via_core:
        core.Window(stream._s, options)
    assert str(via_config.value) == str(via_core.value)


def test_routed_ids_are_checked_by_the_engine_and_never_wrap(stream: ExpertStream) -> None:
    x = np.zeros((2, H), np.float32)
    w = np.full((2, K), 0.5, np.float32)
    with Window(stream) as window:
        for table in ("ids", "pred1", "pred2"):
            good = np.array([[0, 1], [2, 3]])
            args = {"ids": good, "pred1": None, "pred2": None}
            args[table] = np.array([[0, 1], [2, 2**32 + 3]])  # int32 would make it expert 3
            with pytest.raises(IndexError, match=rf"{table}: expert 4294967299 out of range"):
                window.moe_routed(0, x, args["ids"], w, args["pred1"], args["pred2"])
            args[table] = np.array([[0, 1], [2, E]])
            with pytest.raises(IndexError, match=rf"expert id {E} at entry 3 out of range"):
                window.moe_routed(0, x, args["ids"], w, args["pred1"], args["pred2"])
        with pytest.raises(ValueError, match=rf"ids must have shape \[T, {K}\]"):
            window.moe_routed_external(0, np.array([0, 1]), lambda *a: None)
        with pytest.raises(TypeError, match="pred2 must be integer expert ids"):
            window.moe_routed_external(
                0, np.array([[0, 1]]), lambda *a: None, None, np.ones((1, K))
            )


# ---- the test hooks are off the product classes -----------------------------------------------


def test_the_test_hooks_live_in_strata_stream_testing(stream: ExpertStream) -> None:
    hooks = ("run_io", "inject_fault", "clear_faults", "check_invariants", "evict", "pending_io")
    for name in hooks:
        assert not hasattr(ExpertStream, name), name
        assert callable(getattr(testing, name)), name
    for name in ("run_job", "inject_fault", "clear_faults", "check_invariants", "evict_one"):
        assert not hasattr(core.Stream, name), name
    assert "testing" not in strata_stream.__all__  # not part of the product's namespace
    testing.inject_fault(stream, 0, 3, kind="eio")
    with pytest.raises(OSError, match="layer 0 expert 3"):
        testing.wait(stream, 0, [3])
    testing.clear_faults(stream)
    testing.wait(stream, 0, [3])
    assert testing.evict(stream) is not None
    assert testing.check_invariants(stream) == ""


# The steps of the handshake a Window takes in order; one called beside a running Window corrupts
# its state, so the product's stream offers none of them.
HANDSHAKE = (
    "request", "wait", "publish", "enter_layer", "after_layer", "end_turn", "plan",
    "release_plan", "cancel", "retire_unused_pre", "release_limbo", "victim",
)  # fmt: skip
# ExpertStream's whole public surface: opening and closing (and the context manager), the
# geometry, the views and the stats.
STREAM_MEMBERS = {
    "close", "closed", "config", "path", "n_layers", "n_experts", "top_k", "n_slots",
    "record_stride", "direct_io", "direct_note", "arena_view", "expert_bytes", "fill",
    "slot_table", "stats",
}  # fmt: skip


def test_the_stream_offers_no_handshake_step(stream: ExpertStream) -> None:
    public = _public(ExpertStream) | {n for n in vars(stream) if not n.startswith("_")}
    assert public == STREAM_MEMBERS
    for name in (*HANDSHAKE, "slot_bytes", "smap", "key", "where", "n_parts", "part_bytes"):
        assert not hasattr(core.Stream, name), name
        assert callable(getattr(testing, name)), name
    assert not hasattr(core.Stream, "n_clients") and callable(testing.n_clients)
    assert list(inspect.signature(ExpertStream).parameters) == ["pack", "config"]
    assert not hasattr(Window, "moe_routed_host")  # the legacy name of moe_routed_external


def test_the_handshake_hooks_take_the_stream_they_act_on(stream: ExpertStream) -> None:
    assert testing.request(stream, 1, [2, 5]) == (0, 2, 0)
    testing.wait(stream, 1, [2, 5])
    slot = testing.where(stream, 1, 2)
    assert slot is not None and testing.smap(stream)[testing.key(stream, 1, 2)] == slot
    got = stream.expert_bytes(1, 2)
    assert got is not None and got.tobytes() == testing.slot_bytes(stream, slot).tobytes()
    assert stream.expert_bytes(1, 3) is None  # never read
    with pytest.raises(IndexError, match="expert 16 out of range"):
        stream.expert_bytes(1, E)
    testing.enter_layer(stream, 1, [2])
    assert testing.victim(stream) != slot  # protected (I4)
    testing.end_turn(stream)
    assert testing.check_invariants(stream) == ""


# ---- the stub types what the extension binds, and nothing else -------------------------------

STUB = Path(strata_stream.__file__).with_name("_core.pyi")


def _defined(node: ast.stmt) -> str:
    """The name a stub statement defines ("" for none)."""
    if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
        return node.name
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return node.target.id
    if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
        return node.targets[0].id
    return ""


def _stub_names() -> tuple[set[str], dict[str, set[str]]]:
    """The stub's module-level names, and each class's members."""
    tree = ast.parse(STUB.read_text())
    names = {_defined(n) for n in tree.body} - {""}
    members = {
        n.name: {_defined(m) for m in n.body} - {"", "__init__"}
        for n in tree.body
        if isinstance(n, ast.ClassDef)
    }
    return names, members


def _public(obj: object) -> set[str]:
    return {n for n in dir(obj) if not n.startswith("_")}


def test_the_stub_types_the_whole_binding_surface() -> None:
    names, members = _stub_names()
    stub_only = {"Layout", "LayerStats", "PrefetchStats", "ReplayCounts", "_Ids", "_Testing"}
    assert _public(core) == names - stub_only
    assert _public(core.testing) == members["_Testing"]
    for cls in ("Stream", "Window", "WindowOptions"):
        assert _public(getattr(core, cls)) == members[cls], cls
    for enum in ("ReadClass", "SlotState"):
        assert {m.name for m in getattr(core, enum)} == members[enum], enum


def test_the_stub_names_every_layout_and_stats_key(stream: ExpertStream) -> None:
    _, members = _stub_names()
    assert set(stream._s.layout) == members["Layout"]
    with Window(stream) as w:
        assert set(w._w.layer_stats()[0]) == members["LayerStats"]
        assert set(w._w.prefetch_stats()) == members["PrefetchStats"]


def test_the_bench_helpers_are_not_in_core() -> None:
    for name in ("bench_kernels", "bench_raw_read", "crc32"):
        assert not hasattr(core, name), name
    # Not installed (benchmarks/bench_ext.py builds it on demand); a build with
    # STRATA_BUILD_BENCH=ON has it.
    _bench = pytest.importorskip("strata_stream._bench", reason="built with STRATA_BUILD_BENCH")

    assert callable(_bench.bench_kernels) and callable(_bench.bench_raw_read)
    text = STUB.with_name("_bench.pyi").read_text()
    assert set(re.findall(r"^def (\w+)", text, re.M)) == _public(_bench)


# ErrorKind's order in csrc/engine/common/errors.h, and the class each kind must become.
ENGINE_ERROR_CLASSES = [
    "PackError",
    "ConfigError",
    "ExpertReadError",
    "StreamClosedError",
    "StreamTimeoutError",
    "ArenaFullError",
    "TurnError",
    "DeviceError",
]


@pytest.mark.parametrize("kind", range(len(ENGINE_ERROR_CLASSES)))
def test_every_engine_error_kind_becomes_its_strata_stream_class(kind: int) -> None:
    import strata_stream.errors as errors

    cls = getattr(errors, ENGINE_ERROR_CLASSES[kind])
    with pytest.raises(cls, match="planted") as info:
        core.testing.raise_engine_error(kind, "planted")
    assert type(info.value) is cls and isinstance(info.value, errors.StrataError)
    with pytest.raises(ValueError, match="no ErrorKind"):
        core.testing.raise_engine_error(len(ENGINE_ERROR_CLASSES), "x")
