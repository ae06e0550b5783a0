"""The CUDA backend against the CPU reference, in the style of ggml's test-backend-ops: every
pass (route, route_predict, plan, gate_up, down, moe_mm waves, combine) in every pack format,
the same inputs through Window(backend="cpu") and Window(backend="cuda").

Tolerance. Both backends compute each output element as one float32 dot product, in different
fixed orders (the CPU: 16 lanes and a tree; CUDA: 32 lanes of 8-column chunks with fused
multiply-adds and a butterfly; for bf16 weights the tensor cores' float32 sums over k-blocks of
16, x split exactly into three bf16 pieces so that every product is exact), and exp differs by
at most 2 ulp; weights dequantize to the same floats on both. Reordering a float32 sum of n
products moves it by at most about n * 2^-24 * sum|w_i x_i| (n <= 384 here: 2.3e-5 of that
sum, far less in practice: random signs), so the check is max|cuda - cpu| <= 1e-5 * max|cpu|
+ 1e-6, the bound the routed tests already use against the float64 oracle. A planted 2^-10
error in one kernel exceeds it (test_a_planted_kernel_change_fails_the_parity). Within CUDA the
output is bitwise the same at every arena size, split mode, lookahead setting and chunking
(I11).
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from pathlib import Path

import numpy as np
import pytest

from strata_stream import ExpertPack, ExpertStream, StreamConfig, Window, testing
from strata_stream.errors import ConfigError, ExpertReadError
from strata_stream.pack import Geometry, write_pack

from .conftest import cuda_unavailable

L, E, K = 3, 8, 2
RTOL, ATOL = 1e-5, 1e-6

cuda = pytest.mark.cuda


def _experts(g: Geometry, seed: int, biases: bool):  # type: ignore[no-untyped-def]
    def experts(layer: int, expert: int) -> tuple[np.ndarray, ...]:
        rng = np.random.default_rng((seed, layer, expert))
        i, h = g.moe_intermediate, g.hidden
        mats = [
            (rng.standard_normal((i, h)) / np.sqrt(h)).astype(np.float32),
            (rng.standard_normal((i, h)) / np.sqrt(h)).astype(np.float32),
            (rng.standard_normal((h, i)) / np.sqrt(i)).astype(np.float32),
        ]
        if biases:
            mats += [
                rng.standard_normal(i).astype(np.float32) / 4,
                rng.standard_normal(i).astype(np.float32) / 4,
                rng.standard_normal(h).astype(np.float32) / 4,
            ]
        return tuple(mats)

    return experts


def make_pack(
    tmp: Path,
    fmt: str = "f32",
    group: int = 64,
    scale: str = "f16",
    routing: str = "softmax_topk",
    hidden: int = 384,
    inter: int = 128,
    activation: str = "swiglu",
    bias_dtype: str | None = None,
    norm_topk: bool = True,
    seed: int = 0,
) -> Path:
    g = Geometry(L, E, K, hidden, inter, routing, norm_topk, activation=activation)
    rng = np.random.default_rng((seed, 999))
    routers = (
        None
        if routing == "external"
        else [rng.standard_normal((E, hidden)).astype(np.float32) for _ in range(L)]
    )
    path = tmp / f"{fmt}-{group}-{scale}-{routing}-{hidden}-{activation}-{bias_dtype}.strpk"
    write_pack(
        path, g, routers, _experts(g, seed, bias_dtype is not None), weight_format=fmt,
        group_size=group, scale_dtype=scale, bias_dtype=bias_dtype, progress=False,
    )  # fmt: skip
    return path


def config(path: Path, n_slots: int | None = None, **kw: object) -> StreamConfig:
    with ExpertPack.open(path) as p:
        stride = p.record_stride
    n = n_slots if n_slots is not None else L * E
    base: dict[str, object] = dict(
        arena_bytes=n * stride, io_threads=2, direct_io=False, persist_profile=False
    )
    base.update(kw)
    return StreamConfig(**base)  # type: ignore[arg-type]


def turns(hidden: int, sizes: list[int], seed: int = 1) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [[rng.standard_normal((t, hidden)).astype(np.float32) for _ in range(L)] for t in sizes]


def run(path: Path, cfg: StreamConfig, xs: list[list[np.ndarray]], backend: str) -> list:
    out = []
    with ExpertStream(path, cfg) as stream, Window(stream, backend=backend) as w:
        for turn in xs:
            with w.turn():
                out.extend(w.moe(layer, x) for layer, x in enumerate(turn))
    return out


def routed_inputs(hidden: int, rows: int, seed: int = 2) -> tuple[list, list]:
    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal((rows, hidden)).astype(np.float32) for _ in range(L)]
    routes = []
    for _ in range(L):
        ids = np.stack([rng.choice(E, K, replace=False) for _ in range(rows)]).astype(np.int32)
        w = rng.random((rows, K)).astype(np.float32)
        routes.append((ids, w / w.sum(axis=1, keepdims=True)))
    return xs, routes


def run_routed(path: Path, cfg: StreamConfig, xs: list, routes: list, backend: str) -> list:
    outs = []
    with ExpertStream(path, cfg) as stream, Window(stream, backend=backend) as w, w.turn():
        for layer, (x, (ids, wt)) in enumerate(zip(xs, routes, strict=True)):
            nxt = routes[layer + 1][0] if layer + 1 < L else None
            outs.append(w.moe_routed(layer, x, ids, wt, pred1=nxt))
    return outs


def max_violation(got: list, want: list) -> float:
    """The largest |got - want| over the tolerance (<= 1 passes)."""
    worst = 0.0
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and np.isfinite(a).all()
        bound = RTOL * float(np.abs(b).max()) + ATOL
        worst = max(worst, float(np.abs(a - b).max()) / bound)
    return worst


FORMATS = [("f32", 64, "f16"), ("f16", 64, "f16"), ("bf16", 64, "f16"), ("mxfp4", 32, "e8m0")] + [
    (q, g, s) for q in ("q4", "q8") for g in (32, 64, 128) for s in ("f32", "f16", "bf16")
]


@cuda
@pytest.mark.parametrize("arena", ["device", "mapped"])
@pytest.mark.parametrize(("fmt", "group", "scale"), FORMATS)
def test_every_format_matches_the_cpu_backend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str, group: int, scale: str, arena: str
) -> None:
    """Decode (the resident and missing passes) and a prompt chunk (moe_mm waves), routed on the
    device by both routing rules, with the arena mirrored in device memory and mapped."""
    monkeypatch.setenv("STRATA_CUDA_ARENA", arena)
    routing = "topk_softmax" if (group + len(scale)) % 2 else "softmax_topk"
    path = make_pack(tmp_path, fmt, group, scale, routing)
    xs = turns(384, [1, 13, 2])
    # Half the experts resident: decode has both passes, the prompt several waves.
    cfg = config(path, n_slots=2 * K + 2)
    want = run(path, config(path), xs, "cpu")
    assert max_violation(run(path, cfg, xs, "cuda"), want) <= 1.0


@cuda
@pytest.mark.parametrize("fmt", ["f32", "bf16"])
@pytest.mark.parametrize("norm_topk", [False, True])
def test_odd_widths_and_unnormalised_routing(tmp_path: Path, norm_topk: bool, fmt: str) -> None:
    """Float rows whose width is no multiple of the 8-column chunk (hidden 100, intermediate 52);
    for bf16 (the tensor-core kernels) nor of the 16-column k-block and the 16-row tile."""
    path = make_pack(tmp_path, fmt, hidden=100, inter=52, norm_topk=norm_topk)
    xs = turns(100, [1, 9])
    want = run(path, config(path), xs, "cpu")
    assert max_violation(run(path, config(path), xs, "cuda"), want) <= 1.0


ROUTED = [
    ("swiglu", None, "f32", 64, "f16"),
    ("swiglu_oai", "f32", "bf16", 64, "f16"),
    ("swiglu_oai", "f16", "q4", 32, "bf16"),
    ("swiglu_oai", "bf16", "q8", 64, "f32"),
    ("swiglu_oai", "bf16", "mxfp4", 32, "e8m0"),
]


@cuda
@pytest.mark.parametrize(("activation", "bias", "fmt", "group", "scale"), ROUTED)
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_routed_calls_with_biases_and_clamped_swiglu(
    tmp_path: Path, activation: str, bias: str | None, fmt: str, group: int, scale: str, rows: int
) -> None:
    path = make_pack(
        tmp_path, fmt, group, scale, "external", hidden=256, inter=128, activation=activation,
        bias_dtype=bias,
    )  # fmt: skip
    xs, routes = routed_inputs(256, rows)
    want = run_routed(path, config(path), xs, routes, "cpu")
    ref = run_routed(path, config(path), xs, routes, "cuda")
    assert max_violation(ref, want) <= 1.0
    for cfg in (
        config(path, 2 * K),  # the minimum: waves in the prompt path
        config(path, 5, lookahead=False),
        config(path, 7, split_turn=True),
        config(path, max_rows=16, decode_rows=0),
    ):
        got = run_routed(path, cfg, xs, routes, "cuda")
        assert all(np.array_equal(a, b) for a, b in zip(ref, got, strict=True))


@cuda
def test_bitwise_across_arena_sizes_split_lookahead_and_chunking(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """I11 on CUDA: minimum to all-resident arenas, split on/off, lookahead on/off, decode and
    prompt paths, cold and warm turns, device-memory and mapped arenas: the same bits."""
    path = make_pack(tmp_path, "q4", 64, "f16")
    xs = turns(384, [1, 1, 17, 4, 1, 33, 1])
    ref = run(path, config(path), xs, "cuda")
    monkeypatch.setenv("STRATA_CUDA_ARENA", "mapped")
    mapped = run(path, config(path, 2 * K), xs, "cuda")
    assert all(np.array_equal(a, b) for a, b in zip(ref, mapped, strict=True))
    monkeypatch.delenv("STRATA_CUDA_ARENA")
    for cfg in (
        config(path, 2 * K),
        config(path, 2 * K, split_turn=True),
        config(path, 2 * K + 1, lookahead=False),
        config(path, 9, split_turn=True, lookahead=False),
        config(path, 12, max_rows=8),
        config(path, decode_rows=0),
        config(path, 2 * K + 2, two_layer_decode=True, two_layer_prompt=True),
    ):
        got = run(path, cfg, xs, "cuda")
        assert all(np.array_equal(a, b) for a, b in zip(ref, got, strict=True)), cfg
    # Records copied to the device in chunks of parts as they land (the default: chunks of up
    # to 1 MiB, so one here; 32 KiB: two parts a chunk and a last of one; 0: a copy a part), or
    # each whole record at its completion: the minimum arena recycles every layer's slots.
    # Parts of 16 KiB: several a record.
    for fill, chunk_kib in (("parts", ""), ("parts", "32"), ("parts", "0"), ("completion", "")):
        monkeypatch.setenv("STRATA_CUDA_MIRROR_FILL", fill)
        monkeypatch.setenv("STRATA_CUDA_COPY_CHUNK_KIB", chunk_kib)
        for cfg in (
            config(path, 2 * K, part_bytes=1 << 14),
            config(path, 2 * K, part_bytes=1 << 14, split_turn=True),
        ):
            got = run(path, cfg, xs, "cuda")
            assert all(np.array_equal(a, b) for a, b in zip(ref, got, strict=True)), (
                fill,
                chunk_kib,
                cfg,
            )


@cuda
@pytest.mark.parametrize("chunk_kib", ["0", "32"])
def test_part_copies_of_a_failed_read_never_land_over_its_retry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk_kib: str
) -> None:
    """STRATA_CUDA_MIRROR_FILL=parts queues each chunk's device copy once its parts landed and
    goes on without waiting for it; only the record's completion waits for its chunks' copies
    before the slot is tagged and published. A read that fails after some of its chunks were
    queued leaves those copies behind: the slot's next read of each chunk waits for the old
    copy before queueing its own, so no stale copy lands over the new bytes. Here every layer-1
    record fails at its fourth part of 16 KiB (q4 records of five parts) on its first read, at
    the minimum arena, with a copy a part (chunk 0) or chunks of two parts (32 KiB: the first
    chunk copied, the second never complete, the third copied); the stream stays usable and
    the turns after it give a cold run's bits."""
    path = make_pack(tmp_path, "q4", 64, "f16")
    xs = turns(384, [1, 4, 1, 17])
    want = run(path, config(path), xs, "cuda")
    monkeypatch.setenv("STRATA_CUDA_MIRROR_FILL", "parts")
    monkeypatch.setenv("STRATA_CUDA_COPY_CHUNK_KIB", chunk_kib)
    cfg = config(path, 2 * K, part_bytes=1 << 14, lookahead=False)
    with ExpertStream(path, cfg) as stream, Window(stream, backend="cuda") as w:
        for e in range(E):
            testing.inject_fault(stream, 1, e, part=3, kind="eio", count=1)
        with pytest.raises(ExpertReadError), w.turn():
            for layer, x in enumerate(xs[0]):
                w.moe(layer, x)
        testing.clear_faults(stream)
        got: list[np.ndarray] = []
        for turn in xs:
            with w.turn():
                got.extend(w.moe(layer, x) for layer, x in enumerate(turn))
        assert testing.check_invariants(stream) == ""
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))


@cuda
def test_slots_published_before_the_backend_registered_are_copied_before_their_pass(
    tmp_path: Path,
) -> None:
    """Device arena: the mirror is filled at IO completion, by the backend's record observer,
    before the stream publishes a record; a slot published before the backend registered (here
    by a CPU Window on the same stream) has no device copy, and the fallback copies it on the
    kernels' stream before the pass reads it. Then, in a small arena, slots are recycled and
    refilled at IO completion while the same Window runs. The bits are a cold run's."""
    path = make_pack(tmp_path, "q8", 64, "bf16")
    xs = turns(384, [1, 9, 1, 4])
    want = run(path, config(path), xs, "cuda")
    # At IO completion, the whole record or each part as it lands (the default; parts of
    # 16 KiB: several a record).
    for fill, part_bytes in (("completion", 1 << 20), ("parts", 1 << 14)):
        for n_slots in (L * E, 2 * K + 2):
            got: list[np.ndarray] = []
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("STRATA_CUDA_MIRROR_FILL", fill)
                cfg = config(path, n_slots, part_bytes=part_bytes)
                with ExpertStream(path, cfg) as stream:
                    with Window(stream, backend="cpu") as cpu, cpu.turn():  # no observer
                        for layer, x in enumerate(xs[0]):
                            cpu.moe(layer, x)
                    with Window(stream, backend="cuda") as w:
                        for turn in xs:
                            with w.turn():
                                got.extend(w.moe(layer, x) for layer, x in enumerate(turn))
                    assert testing.check_invariants(stream) == ""
            assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True)), (
                fill,
                n_slots,
            )
    # A value the backend does not take (the comparison-only "lazy" fill is gone).
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STRATA_CUDA_MIRROR_FILL", "lazy")
        with (
            ExpertStream(path, config(path)) as stream,
            pytest.raises(
                ConfigError, match="STRATA_CUDA_MIRROR_FILL must be parts or completion, got 'lazy'"
            ),
        ):
            Window(stream, backend="cuda")


@cuda
def test_the_bf16_kernel_family_is_chosen_by_name_and_keeps_the_batch_rule(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """STRATA_CUDA_BF16: auto (the default: wgmma for prompt waves and mma.sync for decode where
    the GPU runs wgmma and the two gave the same bits on a known problem, else mma.sync), mma, or
    wgmma, Hopper's (refused by name on another GPU); any other value is a ConfigError. Under
    wgmma every bf16 pass (decode and prompt waves) takes it, and under auto both take part: the
    CPU parity, and a token's bits the same alone and in a batch, at a small arena too."""
    path = make_pack(tmp_path, "bf16", 64, "f16", "softmax_topk")
    xs = turns(384, [1, 13, 2])
    want = run(path, config(path), xs, "cpu")
    monkeypatch.setenv("STRATA_CUDA_BF16", "fast")
    with (
        ExpertStream(path, config(path)) as stream,
        pytest.raises(ConfigError, match="STRATA_CUDA_BF16 must be auto, mma or wgmma, got 'fast'"),
    ):
        Window(stream, backend="cuda")
    cuda_module = importlib.import_module("strata_stream._cuda")
    why = cuda_module.wgmma_unavailable()
    monkeypatch.delenv("STRATA_CUDA_BF16")
    family = cuda_module.bf16_family()
    # Where wgmma runs, the default mixes the families (the known-answer check passed on the
    # H200); elsewhere it says mma.sync, with the reason.
    assert family.startswith("auto: wgmma from ") if not why else why in family, family
    monkeypatch.setenv("STRATA_CUDA_BF16", "mma")
    assert cuda_module.bf16_family() == "mma.sync (every bf16 pass)"
    monkeypatch.setenv("STRATA_CUDA_BF16", "wgmma")
    if why:
        with (
            ExpertStream(path, config(path)) as stream,
            pytest.raises(ConfigError, match="STRATA_CUDA_BF16=wgmma: "),
        ):
            Window(stream, backend="cuda")
        return
    for cfg in (config(path), config(path, 2 * K + 2), config(path, 2 * K, split_turn=True)):
        assert max_violation(run(path, cfg, xs, "cuda"), want) <= 1.0, cfg
    rng = np.random.default_rng(5)
    batch = [rng.standard_normal((40, 384)).astype(np.float32) for _ in range(L)]
    alone, many = (run(path, config(path), [[x[:t] for x in batch]], "cuda") for t in (1, 40))
    for a, m in zip(alone, many, strict=True):
        assert np.array_equal(a[0], m[0])


@cuda
@pytest.mark.parametrize(
    ("plant", "fmt"), [("gate_up", "q4"), ("gate_up", "bf16"), ("route", "q4")]
)
def test_a_planted_kernel_change_fails_the_parity(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plant: str, fmt: str
) -> None:
    """The parity check can fail: a 2^-10 change in one kernel (STRATA_CUDA_TEST_PLANT, read
    when a CUDA backend binds, in kernels built with the CMake option of that name) is caught;
    without it the same check passes. bf16's gate_up is the tensor-core kernel (decode and
    prompt tilings), q4's the float32 FMA kernels."""
    path = make_pack(tmp_path, fmt, 64, "bf16")
    xs = turns(384, [1, 13])
    want = run(path, config(path), xs, "cpu")
    assert max_violation(run(path, config(path), xs, "cuda"), want) <= 1.0
    monkeypatch.setenv("STRATA_CUDA_TEST_PLANT", plant)
    assert max_violation(run(path, config(path), xs, "cuda"), want) > 1.0, (
        "no planted error: the kernels need a build with -DSTRATA_CUDA_TEST_PLANT=ON "
        "(tests/cuda/device_run.sh builds so)"
    )


@cuda
def test_two_windows_on_one_stream_from_two_threads(tmp_path: Path) -> None:
    path = make_pack(tmp_path, "bf16", 64, "f16")
    xs = [turns(384, [1, 5, 1], seed=s) for s in (3, 4)]
    want = [run(path, config(path), x, "cuda") for x in xs]
    got: list[list] = [[], []]
    errors: list[BaseException] = []
    with ExpertStream(path, config(path, 4 * K + 2)) as stream:

        def drive(i: int) -> None:
            try:
                with Window(stream, backend="cuda") as w:
                    for turn in xs[i]:
                        with w.turn():
                            got[i].extend(w.moe(layer, x) for layer, x in enumerate(turn))
            except BaseException as e:  # re-raised on the test's thread
                errors.append(e)

        threads = [threading.Thread(target=drive, args=(i,), daemon=True) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
            assert not t.is_alive(), "a Window hung"
        assert not errors, errors
        assert testing.check_invariants(stream) == ""
    for i in (0, 1):
        assert all(np.array_equal(a, b) for a, b in zip(got[i], want[i], strict=True))


@cuda
def test_a_queued_completion_keeps_its_slots_until_the_backend_drained(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """moe_routed_device with the caller's stream returns with the kernels queued, the caller's
    (torch's) stream waiting on them. In an arena of two layers' top-k every layer's urgent
    reads recycle the layer before's slots and refill their mirror slots at IO completion, so a
    release of a layer before its kernels finished would let a copy overwrite bytes a queued
    kernel still reads. Many tokens, never a synchronization between calls (each output is
    copied on torch's stream right after its call, behind the wait): the bits are those of the
    calls that wait (no stream) with every expert resident, in both mirror fills, and the CPU
    backend's within the tolerance. The mapped arena keeps waiting (its error word needs the
    drain), with the same bits."""
    torch = pytest.importorskip("torch")
    path = make_pack(tmp_path, "q4", 64, "f16")
    rng = np.random.default_rng(5)
    calls = []
    for _ in range(16):  # tokens, each through every layer
        for layer in range(L):
            ids = rng.choice(E, K, replace=False).astype(np.int32)[None]
            wt = rng.random((1, K)).astype(np.float32)
            calls.append((layer, rng.standard_normal((1, 384)).astype(np.float32), ids, wt))
    xs = [torch.from_numpy(x).cuda() for _, x, _, _ in calls]
    torch.cuda.synchronize()  # the caller's part: x complete before its call

    def drive(
        cfg: StreamConfig, queued: bool, explicit: bool = False
    ) -> tuple[list[np.ndarray], list[bool]]:
        copies, pending = [], []
        with ExpertStream(path, cfg) as stream:
            with Window(stream, backend="cuda") as w:
                s = torch.cuda.current_stream().cuda_stream
                with w.turn() if explicit else contextlib.nullcontext():
                    for (layer, _, ids, wt), x in zip(calls, xs, strict=True):
                        out = torch.empty_like(x)
                        w.moe_routed_device(layer, x, ids, wt, out, stream=s if queued else None)
                        pending.append(w.completion_pending)
                        copies.append(out.clone())  # on torch's stream: after the experts
                # An explicit turn's end retired the last call; an implicit turn that ended with
                # it queued owes the stream its end until the next call or close().
                assert w.completion_pending == (pending[-1] and not explicit)
                torch.cuda.synchronize()  # torch's stream waited for every layer's kernels
            assert testing.check_invariants(stream) == ""  # close() retired a pending one
        return [c.cpu().numpy() for c in copies], pending

    want, waited = drive(config(path), False)
    assert not any(waited)
    for cfg, explicit in (
        (config(path, 2 * K), False),
        (config(path, 2 * K, split_turn=True), False),
        (config(path, 2 * K), True),
        (config(path), False),
    ):
        got, pending = drive(cfg, True, explicit)
        assert all(pending), "the calls returned with their kernels queued"
        assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True)), cfg
    with ExpertStream(path, config(path)) as stream, Window(stream, backend="cpu") as cpu:
        ref = [cpu.moe_routed(layer, x, ids, wt) for layer, x, ids, wt in calls]
    assert max_violation(want, ref) <= 1.0
    monkeypatch.setenv("STRATA_CUDA_ARENA", "mapped")
    got, pending = drive(config(path, 2 * K), True)
    assert not any(pending)
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))


@cuda
@pytest.mark.parametrize("decode_batch_rows", [0, 64])
def test_a_queued_calls_chunks_run_back_to_back_with_their_slots_kept(
    tmp_path: Path, decode_batch_rows: int
) -> None:
    """A call of 24 rows in chunks of 8 given the caller's stream: every chunk returns queued,
    and the next keeps the queued chunks' experts protected when they all fit a wave (an
    arena of one call's experts and a top-k: each layer's reads recycle the layer before's
    slots and refill their mirror slots at IO completion, under kernels still queued), or
    drains them first when not (the minimum arena: waves of two experts). The bits are those of
    the same chunks drained one by one (no stream) with every expert resident, in waves
    (decode_batch_rows 0) and on the decode path (a chunk's 8 experts in one submission)."""
    torch = pytest.importorskip("torch")
    path = make_pack(tmp_path, "q4", 64, "f16")
    rng = np.random.default_rng(11)
    rows = 24
    calls = []
    for _ in range(3):  # turns, each through every layer
        for layer in range(L):
            ids = np.stack([rng.choice(E, K, replace=False) for _ in range(rows)]).astype(np.int32)
            wt = rng.random((rows, K)).astype(np.float32)
            calls.append((layer, torch.randn(rows, 384, device="cuda"), ids, wt))
    torch.cuda.synchronize()

    def drive(n_slots: int | None, queued: bool) -> list[np.ndarray]:
        cfg = config(path, n_slots, max_rows=8, decode_batch_rows=decode_batch_rows)
        copies = []
        with ExpertStream(path, cfg) as stream, Window(stream, backend="cuda") as w:
            s = torch.cuda.current_stream().cuda_stream
            for layer, x, ids, wt in calls:
                out = torch.empty_like(x)
                w.moe_routed_device(layer, x, ids, wt, out, stream=s if queued else None)
                assert w.completion_pending == queued
                copies.append(out.clone())  # on torch's stream: after the experts
            torch.cuda.synchronize()
            w.close()
            assert testing.check_invariants(stream) == ""
            evicted = stream.stats()["evicted"]
        assert n_slots is None or evicted > 0, "the layers recycled each other's slots"
        return [c.cpu().numpy() for c in copies]

    want = drive(None, False)
    for n_slots in (E + K, 2 * K):
        got = drive(n_slots, True)
        assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True)), n_slots


@cuda
def test_close_during_moe_leaves_the_stream_usable(tmp_path: Path) -> None:
    path = make_pack(tmp_path, "f16", 64, "f16")
    xs = turns(384, [1])[0]
    want = run(path, config(path), [xs], "cuda")
    with ExpertStream(path, config(path, 2 * K, lookahead=False)) as stream:
        w = Window(stream, backend="cuda")
        testing.inject_fault(stream, 1, 0, kind="delay", delay_s=0.2, count=-1)
        for e in range(1, E):
            testing.inject_fault(stream, 1, e, kind="delay", delay_s=0.2, count=-1)
        entered = threading.Event()
        outputs: list[np.ndarray] = []
        failure: list[BaseException] = []

        def drive() -> None:
            try:
                for _ in range(100):
                    with w.turn():
                        for layer, x in enumerate(xs):
                            entered.set()
                            outputs.append(w.moe(layer, x))
            except BaseException as e:
                failure.append(e)

        t = threading.Thread(target=drive, daemon=True)
        t.start()
        assert entered.wait(60)
        w.close()
        t.join(60)
        assert not t.is_alive() and failure, "close() failed the turn in flight"
        assert all(np.array_equal(o, want[i % L]) for i, o in enumerate(outputs))
        assert testing.check_invariants(stream) == ""
        testing.clear_faults(stream)
        with Window(stream, backend="cuda") as again, again.turn():
            got = [again.moe(layer, x) for layer, x in enumerate(xs)]
        assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))


@cuda
@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("STRATA_CUDA_ARENA", "unified", "STRATA_CUDA_ARENA must be device or mapped"),
        ("STRATA_CUDA_MIRROR_FILL", "lazy", "STRATA_CUDA_MIRROR_FILL must be parts or completion"),
        ("STRATA_CUDA_BF16", "fast", "STRATA_CUDA_BF16 must be auto, mma or wgmma"),
        ("STRATA_CUDA_COPY_CHUNK_KIB", "-1", "STRATA_CUDA_COPY_CHUNK_KIB must be KiB"),
        ("STRATA_CUDA_COPY_CHUNK_KIB", "65537", "STRATA_CUDA_COPY_CHUNK_KIB must be KiB"),
        ("STRATA_CUDA_COPY_CHUNK_KIB", "1M", "STRATA_CUDA_COPY_CHUNK_KIB must be KiB"),
    ],
)
def test_a_bad_backend_setting_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, value: str, message: str
) -> None:
    path = make_pack(tmp_path, "f32", hidden=64, inter=32)
    monkeypatch.setenv(name, value)
    with ExpertStream(path, config(path)) as stream, pytest.raises(ConfigError, match=message):
        Window(stream, backend="cuda")


def test_cuda_without_a_gpu_is_a_clear_config_error(tmp_path: Path) -> None:
    """Not marked: this is the check that runs where there is no GPU (CI)."""
    why = cuda_unavailable()
    if why == "":
        pytest.skip("a CUDA GPU is present: backend='cuda' runs here")
    path = make_pack(tmp_path, "f32", hidden=64, inter=32)
    with ExpertStream(path, config(path)) as stream:
        with pytest.raises(ConfigError, match="backend 'cuda'"):
            Window(stream, backend="cuda")
        with Window(stream, backend="auto") as w:  # auto falls back to the CPU
            assert w.stats()["backend"] == "cpu"


@cuda
def test_stats_show_the_tuning_the_backend_read_when_it_was_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = make_pack(tmp_path)
    monkeypatch.setenv("STRATA_CUDA_COPY_CHUNK_KIB", "512")
    with ExpertStream(path, config(path)) as stream:
        with Window(stream, backend="cuda") as w:
            monkeypatch.setenv("STRATA_CUDA_COPY_CHUNK_KIB", "64")  # read once, at the start
            tuning = w.stats()["backend_tuning"]
        with Window(stream, backend="cpu") as w:
            assert w.stats()["backend_tuning"] == ""
    assert "STRATA_CUDA_COPY_CHUNK_KIB=512" in tuning
    assert "STRATA_CUDA_ARENA=device" in tuning
