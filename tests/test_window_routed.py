"""Window.moe_routed / moe_routed_external: the model routes, the engine streams and computes.

Checked against a numpy oracle of the block equations (biases and gpt-oss's clamped SwiGLU
included), bitwise across arena sizes, lookahead, split turns and decode/prompt paths (I11), and
for the host path: every entry is offered exactly once, with the slot that holds its expert.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from strata_stream import ExpertStream, StreamConfig, Window, testing
from strata_stream.errors import ConfigError, PackError
from strata_stream.pack import ExpertPack, Geometry, write_pack
from strata_stream.pack.header import MatrixFormat
from strata_stream.stream import ABSENT

L, E, K, H, INTER = 4, 16, 2, 64, 64
Any = npt.NDArray[np.float64]


def _routing(rng: np.random.Generator, rows: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(rows)]).astype(np.int32)
    w = rng.random((rows, K)).astype(np.float32)
    return ids, w / w.sum(axis=1, keepdims=True)


def _pack(
    tmp_path: Path,
    name: str,
    activation: str = "swiglu",
    bias_dtype: str | None = None,
    weight_format: str = "f32",
) -> Path:
    g = Geometry(L, E, K, H, INTER, "external", True, activation=activation)
    n_mats = 6 if bias_dtype else 3

    def experts(layer: int, expert: int) -> tuple[np.ndarray, ...]:
        rng = np.random.default_rng((layer, expert))
        mats = [
            (rng.standard_normal((INTER, H)) / 8).astype(np.float32),
            (rng.standard_normal((INTER, H)) / 8).astype(np.float32),
            (rng.standard_normal((H, INTER)) / 8).astype(np.float32),
            (rng.standard_normal(INTER)).astype(np.float32),
            (rng.standard_normal(INTER)).astype(np.float32),
            (rng.standard_normal(H)).astype(np.float32),
        ]
        return tuple(mats[:n_mats])

    path = tmp_path / f"{name}.strpk"
    layer_formats: tuple = ()
    if weight_format == "mixed":  # by matrix and by layer, as mlx-lm's predicates make them
        q4, q8 = MatrixFormat("q4", 32, "bf16"), MatrixFormat("q8", 64, "f32")
        mx4, f16 = MatrixFormat("mxfp4", 32, "e8m0"), MatrixFormat("f16")
        layer_formats = ((q4, q4, q8), (f16, f16, f16), (q8, mx4, q4), (q4, q4, q8))
        weight_format = "q4"
    write_pack(
        path, g, None, experts, weight_format=weight_format, group_size=32,
        scale_dtype="e8m0" if weight_format == "mxfp4" else "bf16", bias_dtype=bias_dtype,
        progress=False, layer_formats=layer_formats,
    )  # fmt: skip
    return path


def _oracle(pack: ExpertPack, layer: int, x: np.ndarray, ids: np.ndarray, w: np.ndarray) -> Any:
    g = pack.geometry
    out = np.zeros(x.shape, np.float64)
    for t in range(x.shape[0]):
        for j in range(K):
            e = int(ids[t, j])
            gate, up, down = (m.astype(np.float64) for m in pack.expert_weights(layer, e))
            gb, ub, db = (b.astype(np.float64) for b in pack.expert_biases(layer, e))
            a, u = gate @ x[t] + gb, up @ x[t] + ub
            if g.activation == "swiglu":
                h = a / (1 + np.exp(-a)) * u
            else:
                a = np.minimum(a, g.act_limit)
                u = np.clip(u, -g.act_limit, g.act_limit)
                h = (u + 1) * (a / (1 + np.exp(-g.act_alpha * a)))
            out[t] += w[t, j] * (down @ h + db)
    return out


def _run(path: Path, config: StreamConfig, xs: list[np.ndarray], routes: list[tuple]) -> list:
    outs = []
    with ExpertStream(path, config) as stream, Window(stream) as window, window.turn():
        for layer, (x, (ids, w)) in enumerate(zip(xs, routes, strict=True)):
            nxt = routes[layer + 1][0] if layer + 1 < L else None
            outs.append(window.moe_routed(layer, x, ids, w, pred1=nxt))
    return outs


@pytest.mark.parametrize(
    ("activation", "bias_dtype", "fmt"),
    [
        ("swiglu", None, "f32"),
        ("swiglu_oai", "bf16", "q4"),
        ("swiglu_oai", "f32", "bf16"),
        ("swiglu_oai", "bf16", "mxfp4"),
        ("swiglu", None, "mixed"),
        ("swiglu_oai", "f32", "mixed"),
    ],
)
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_routed_matches_the_oracle_and_is_bitwise_across_configs(
    tmp_path: Path, activation: str, bias_dtype: str | None, fmt: str, rows: int
) -> None:
    path = _pack(tmp_path, "p", activation, bias_dtype, fmt)
    rng = np.random.default_rng(rows)
    xs = [rng.standard_normal((rows, H)).astype(np.float32) for _ in range(L)]
    routes = [_routing(rng, rows) for _ in range(L)]
    with ExpertStream(path) as s:
        stride = s.record_stride
    base = StreamConfig(arena_bytes=E * L * stride, io_threads=2, direct_io=False)
    ref = _run(path, base, xs, routes)
    with ExpertPack.open(path) as pack:
        for layer in range(L):
            want = _oracle(pack, layer, xs[layer], *routes[layer])
            scale = np.abs(want).max()
            assert np.abs(ref[layer] - want).max() <= 1e-5 * scale + 1e-6
    for cfg in (
        base.replace(arena_bytes=2 * K * stride),  # the minimum: waves in the prompt path
        base.replace(arena_bytes=5 * stride, lookahead=False),
        base.replace(arena_bytes=7 * stride, split_turn=True),
        base.replace(max_rows=16, decode_rows=0),
    ):
        got = _run(path, cfg, xs, routes)
        for a, b in zip(ref, got, strict=True):
            assert np.array_equal(a, b)


def test_x_is_read_from_mlx_in_place_for_every_dtype(tmp_path: Path) -> None:
    mx = pytest.importorskip("mlx.core")
    path = _pack(tmp_path, "p")
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, H)).astype(np.float32)
    ids, w = _routing(rng, 5)
    cfg = StreamConfig(arena_bytes=1 << 24, io_threads=1, direct_io=False)
    with ExpertStream(path, cfg) as stream, Window(stream) as window:
        outs = {}
        for dtype in (mx.float32, mx.float16, mx.bfloat16):
            xm = mx.array(x).astype(dtype)
            mx.eval(xm)
            with window.turn():
                outs[str(dtype)] = window.moe_routed(0, xm, ids, w)
                for layer in range(1, L):
                    window.moe_routed(layer, x, ids, w)
            # The engine saw exactly the values the mx.array holds.
            with window.turn():
                want = window.moe_routed(0, np.array(xm.astype(mx.float32)), ids, w)
                for layer in range(1, L):
                    window.moe_routed(layer, x, ids, w)
            assert np.array_equal(outs[str(dtype)], want)


class _Checker:
    """A host compute that checks each offered slot holds the entry's expert, byte for byte."""

    def __init__(self, pack: ExpertPack, arena: np.ndarray, layer: int, ids: np.ndarray) -> None:
        self.pack, self.arena, self.layer, self.ids = pack, arena, layer, ids
        self.seen = np.zeros(ids.shape, np.int32)
        self.calls = 0

    def __call__(self, row0: int, n: int, slots: np.ndarray) -> None:
        self.calls += 1
        for t in range(n):
            for j in range(K):
                s = int(slots[t, j])
                if s == ABSENT:
                    continue
                self.seen[row0 + t, j] += 1
                e = int(self.ids[row0 + t, j])
                got = self.arena[s, : self.pack.record_bytes].tobytes()
                assert got == self.pack.read_record(self.layer, e)


def test_host_path_offers_every_entry_once_with_its_experts_slot(tmp_path: Path) -> None:
    path = _pack(tmp_path, "p", "swiglu_oai", "bf16", "q4")
    rng = np.random.default_rng(5)
    rows = 24
    routes = [_routing(rng, rows) for _ in range(L)]
    for n_slots in (2 * K, 6, E * L):
        with ExpertPack.open(path) as pack:
            stride = pack.record_stride
            cfg = StreamConfig(arena_bytes=n_slots * stride, io_threads=2, direct_io=False)
            with ExpertStream(path, cfg) as stream, Window(stream) as window, window.turn():
                for layer, (ids, _) in enumerate(routes):
                    check = _Checker(pack, stream.arena_view(), layer, ids)
                    nxt = routes[layer + 1][0] if layer + 1 < L else None
                    window.moe_routed_external(layer, ids, check, pred1=nxt)
                    assert (check.seen == 1).all()
                    if n_slots == 2 * K:
                        assert check.calls > 1  # the minimum arena takes several waves


def test_routed_arguments_are_validated(tmp_path: Path) -> None:
    path = _pack(tmp_path, "p")
    x = np.zeros((2, H), np.float32)
    ids = np.array([[0, 1], [2, 3]], np.int32)
    w = np.full((2, K), 0.5, np.float32)
    cfg = StreamConfig(arena_bytes=1 << 24, io_threads=1, direct_io=False)
    with ExpertStream(path, cfg) as stream, Window(stream) as window:
        with pytest.raises(ConfigError, match="holds no routers"):
            window.moe(0, x)
        with pytest.raises(IndexError, match=r"expert id 16 at entry 1 out of range \[0, 16\)"):
            window.moe_routed(0, x, np.array([[0, 16], [1, 2]]), w)
        with pytest.raises(IndexError, match=r"expert id -1 at entry 1 out of range \[0, 16\)"):
            window.moe_routed(0, x, ids, w, pred1=np.array([[0, -1], [1, 2]]))
        with pytest.raises(ValueError, match=r"ids must have shape \[2, 2\]"):
            window.moe_routed(0, x, ids[:1], w)
        with pytest.raises(ValueError, match=r"weights must have shape"):
            window.moe_routed(0, x, ids, w[:, :1])
        with pytest.raises(ValueError, match=r"x must have shape \[T, 64\]"):
            window.moe_routed(0, np.zeros((2, 8), np.float32), ids, w)
        with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
            window.moe_routed(0, np.zeros((2, H), np.float64), ids, w)
        with pytest.raises(ValueError, match="C-contiguous"):
            window.moe_routed(0, np.zeros((H, 2), np.float32).T, ids, w)
        with pytest.raises(TypeError, match="integer expert ids"):
            window.moe_routed(0, x, ids.astype(np.float32), w)

        def boom(row0: int, n: int, slots: np.ndarray) -> None:
            raise RuntimeError("compute failed")

        with pytest.raises(RuntimeError, match="compute failed"):
            window.moe_routed_external(0, ids, boom)
        # The failed call ended the turn; the stream stays usable.
        with window.turn():
            for layer in range(L):
                out = window.moe_routed(layer, x, ids, w)
        assert np.isfinite(out).all()
        assert testing.check_invariants(stream) == ""
    moce = cfg.replace(moce="scale")
    with (
        ExpertStream(path, moce) as stream,
        Window(stream) as window,
        pytest.raises(ConfigError, match="moce off"),
    ):
        window.moe_routed(0, x, ids, w)


def test_external_pack_has_no_routers(tmp_path: Path) -> None:
    path = _pack(tmp_path, "p", "swiglu_oai", "bf16")
    with ExpertPack.open(path) as pack:
        assert pack.header.router_bytes == 0
        assert pack.geometry.activation == "swiglu_oai"
        assert pack.geometry.act_alpha == pytest.approx(1.702)
        assert pack.bias_dtype == "bf16"
        with pytest.raises(PackError, match="holds no routers"):
            pack.router_weights(0)
        assert pack.verify(progress=False) == L * E


@pytest.mark.parametrize(
    ("fmt", "bias_dtype", "bf16_why", "f32_why"),
    [
        ("q4", None, "", "needs float32 scales"),  # _pack's q4 scales are bf16
        ("mxfp4", "bf16", "", "biases in the activations' dtype"),
        ("f32", None, "q4/q8/mxfp4", "q4/q8/mxfp4"),
    ],
)
def test_the_window_says_which_mlx_arithmetic_it_can_run(
    tmp_path: Path, fmt: str, bias_dtype: str | None, bf16_why: str, f32_why: str
) -> None:
    act = "swiglu_oai" if bias_dtype else "swiglu"
    path = _pack(tmp_path, "p", act, bias_dtype, fmt)
    with ExpertStream(path) as stream, Window(stream) as window:
        for x_dtype, want in (("bfloat16", bf16_why), ("float32", f32_why)):
            why = window.arithmetic_unsupported(x_dtype)
            assert (why == "") if not want else (want in why), (x_dtype, why)
        with pytest.raises(ConfigError, match="x_dtype"):
            window.arithmetic_unsupported("float16")


_FLAGS = {"prefetch2": "two_layer_decode", "two_layer_prompt": "two_layer_prompt"}


@pytest.mark.parametrize("flag", list(_FLAGS))
@pytest.mark.parametrize("path", ["moe_routed", "moe_routed_external"])
@pytest.mark.parametrize("rows", [1, 12])
def test_each_two_layer_flag_alone_predicts_and_reads_on_both_expert_paths(
    tmp_path: Path, flag: str, path: str, rows: int
) -> None:
    """STRATA_METAL_PREFETCH2 alone: two-layer lookahead for decode-sized calls only;
    STRATA_METAL_PROMPT_PRED2 alone: for larger calls only; the same on the CPU-backend path and
    on the caller-computes path. The caller brings every prediction, the engine says which it
    uses (wants_predictions), and exactly those are read: manual IO keeps every speculative read
    queued where the slot table shows its class."""
    from strata_stream import ReadClass

    pack_path = _pack(tmp_path, "p")
    rng = np.random.default_rng(9)
    routes = [_routing(rng, rows) for _ in range(3)]
    x = rng.standard_normal((rows, H)).astype(np.float32)
    with ExpertPack.open(pack_path) as pack:
        cfg = StreamConfig(
            arena_bytes=L * E * pack.record_stride, io_threads=0, direct_io=False,
            start_layers=0, prefetch_backoff=False, persist_profile=False,
            **{_FLAGS[flag]: True},
        )  # fmt: skip
    decode_sized = rows <= cfg.decode_rows
    two_layer = decode_sized if flag == "prefetch2" else not decode_sized
    with ExpertStream(pack_path, cfg) as stream, Window(stream) as window, window.turn():
        assert window.wants_predictions(0, rows) == (True, two_layer)
        # I10: layer L-2 has no layer beyond the next, L-1 none at all, whatever the flags.
        assert window.wants_predictions(L - 2, rows) == (True, False)
        assert window.wants_predictions(L - 1, rows) == (False, False)
        ids, w = routes[0]
        pred1, pred2 = routes[1][0], routes[2][0]
        if path == "moe_routed":
            window.moe_routed(0, x, ids, w, pred1=pred1, pred2=pred2)
        else:
            window.moe_routed_external(0, ids, lambda *_: None, pred1=pred1, pred2=pred2)
        table = stream.slot_table()
        spec = stream.stats()["spec_requests"]

    def queued(layer: int, cls: Any) -> set[int]:
        return {
            int(k) % E
            for k, c, st in zip(table["key"], table["cls"], table["state"], strict=True)
            if st != 0 and int(k) // E == layer and c == cls
        }

    want1 = set(pred1.ravel().tolist())
    want2 = set(pred2.ravel().tolist()) if two_layer else set()
    assert queued(1, ReadClass.PRED1) == want1
    assert queued(2, ReadClass.PRED2) == want2
    assert spec == len(want1) + len(want2)  # read: exactly what was predicted, nothing else


def test_prediction_precision_is_counted_per_chunk_of_a_long_call(tmp_path: Path) -> None:
    """A call of several chunks notes each chunk's router l+1 picks and compares them with that
    chunk's own choice at layer l+1: the sums Window.stats() reports, from the routing alone."""
    pack_path = _pack(tmp_path, "p")
    rng = np.random.default_rng(3)
    rows, max_rows = 12, 5
    routes = [_routing(rng, rows) for _ in range(2)]
    predicted, actual = _routing(rng, rows)[0], routes[1][0]  # a guess that is partly right
    x = rng.standard_normal((rows, H)).astype(np.float32)
    with ExpertPack.open(pack_path) as pack:
        cfg = StreamConfig(
            arena_bytes=L * E * pack.record_stride, io_threads=2, direct_io=False,
            max_rows=max_rows, persist_profile=False,
        )  # fmt: skip
    with ExpertStream(pack_path, cfg) as stream, Window(stream) as window, window.turn():
        window.moe_routed(0, x, *routes[0], pred1=predicted)
        window.moe_routed(1, x, *routes[1])
        got = window.stats()["layers"][1]
    want = {"pred_correct": 0, "pred_predicted": 0, "pred_actual": 0}
    for r0 in range(0, rows, max_rows):
        p = set(predicted[r0 : r0 + max_rows].ravel().tolist())
        a = set(actual[r0 : r0 + max_rows].ravel().tolist())
        want["pred_correct"] += len(p & a)
        want["pred_predicted"] += len(p)
        want["pred_actual"] += len(a)
    assert 0 < want["pred_correct"] < want["pred_predicted"]  # the check can tell them apart
    assert {k: got[k] for k in want} == want


@pytest.mark.parametrize("all_fit", [True, False])
def test_no_prediction_of_a_layer_resident_for_good(tmp_path: Path, all_fit: bool) -> None:
    """With an arena of every expert, a layer whose experts are all published stays so, and a
    prediction of it would read and protect nothing: wants_predictions leaves it out (at
    all-resident decode the caller then runs no next-layer gate). With a smaller arena the same
    resident layer can still be evicted, so its prediction stays. Output is the same bits."""
    pack_path = _pack(tmp_path, "p")
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, H)).astype(np.float32)
    with ExpertPack.open(pack_path) as pack:
        slots = L * E if all_fit else L * E - 1
        cfg = StreamConfig(
            arena_bytes=slots * pack.record_stride, io_threads=2, direct_io=False,
            prefetch_backoff=False, persist_profile=False, two_layer_decode=True,
        )  # fmt: skip
    every = np.tile(np.arange(E, dtype=np.int32), (E // K, 1)).reshape(-1, K)  # each expert once
    w_every = np.full(every.shape, 1.0 / K, dtype=np.float32)
    ids, w = _routing(rng, 1)
    with ExpertStream(pack_path, cfg) as stream, Window(stream) as window:
        assert window.wants_predictions(0, 1) == (True, True)  # nothing resident yet
        with window.turn():  # reads every expert of layers 0 and 1 (and 2, 3 for the turn)
            for layer in range(L):
                window.moe_routed(layer, np.repeat(x, len(every), 0), every, w_every)
        smap = testing.smap(stream)
        layer1 = smap[E : 2 * E] != ABSENT
        assert layer1.all() and (smap[2 * E : 3 * E] != ABSENT).all()
        assert window.wants_predictions(0, 1) == ((False, False) if all_fit else (True, True))
        with window.turn():  # the caller brings what the engine wants; the bits do not care
            want = window.wants_predictions(0, 1)
            y = window.moe_routed(0, x, ids, w, pred1=ids if want[0] else None,
                                  pred2=ids if want[1] else None)  # fmt: skip
            for layer in range(1, L):
                window.moe_routed(layer, x, ids, w)
        with window.turn():
            y_pred = window.moe_routed(0, x, ids, w, pred1=ids, pred2=ids)
            for layer in range(1, L):
                window.moe_routed(layer, x, ids, w)
    assert np.array_equal(y, y_pred)


@pytest.mark.parametrize("rows", [1, 3, 40])
@pytest.mark.parametrize("slots", [2 * K, 5, None])
def test_per_entry_outputs_are_the_entries_of_the_sum(
    tmp_path: Path, rows: int, slots: int | None
) -> None:
    """per_entry=True returns [T, k, hidden], each (row, k) entry's weighted expert output:
    summed in k order they are the combined output bitwise, weights None gives the unweighted
    outputs (weight 1), on the decode path and in waves at the minimum arena alike."""
    path = _pack(tmp_path, "p", "swiglu_oai", "bf16", "q4")
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, H)).astype(np.float32)
    ids, w = _routing(rng, rows)
    with ExpertStream(path) as s:
        stride = s.record_stride
    n = slots if slots is not None else E * L
    cfg = StreamConfig(arena_bytes=n * stride, io_threads=2, direct_io=False)
    with ExpertStream(path, cfg) as stream, Window(stream) as window:
        assert window.per_entry_unsupported == ""
        with window.turn():
            summed = window.moe_routed(0, x, ids, w)
        with window.turn():
            entries = window.moe_routed(0, x, ids, w, per_entry=True)
        with window.turn():
            bare = window.moe_routed(0, x, ids, None, per_entry=True)
    assert entries.shape == (rows, K, H) and bare.shape == (rows, K, H)
    acc = np.zeros((rows, H), np.float32)
    for j in range(K):
        acc = acc + entries[:, j]
    assert np.array_equal(acc, summed)
    assert np.array_equal(bare * w[:, :, None], entries)  # float32 products, rounded once
    with ExpertPack.open(path) as pack:
        want = _oracle(pack, 0, x, ids, np.ones_like(w))
    assert np.abs(bare.sum(axis=1) - want).max() <= 1e-5 * np.abs(want).max() + 1e-6
    with (
        ExpertStream(path, cfg) as stream,
        Window(stream) as window,
        window.turn(),
        pytest.raises(TypeError, match="weights"),
    ):
        window.moe_routed(0, x, ids, None)  # weights are needed for the sum
