"""`strata-stream plan`: each figure checked against arithmetic of its own (the bytes the
safetensors files hold, the pack the converter really writes, the arena rule on that pack)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

from strata_stream.arena_budget import arena_size
from strata_stream.cli import main
from strata_stream.convert import convert
from strata_stream.doctor.disk import DiskReading
from strata_stream.doctor.memory import MemoryReport
from strata_stream.doctor.saved import DoctorResult
from strata_stream.pack.reader import ExpertPack
from strata_stream.plan import make_plan
from strata_stream.plan.arena import plan_arena
from strata_stream.plan.hit_rate import REFERENCE_TRACE, expected_hit_rate, trace_slots
from strata_stream.plan.model_bytes import model_bytes
from strata_stream.plan.speed import Rate, decode_speed, read_rate
from strata_stream.trace.format import read_trace, write_strata_trace

DATA = Path(__file__).parent / "data"
LAYERS, EXPERTS, TOP_K, HIDDEN, INTER = 2, 4, 2, 64, 128


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No test reads the user's saved doctor result or writes in the user's cache."""
    monkeypatch.setenv("STRATA_CACHE", str(tmp_path / "cache"))


def _checkpoint(path: Path, dtype: Any = np.float16) -> tuple[int, int]:
    """A Mixtral-style per-expert checkpoint in two shards; returns (dense, expert) bytes as
    written."""
    rng = np.random.default_rng(0)
    path.mkdir(parents=True)
    (path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "mixtral",
                "hidden_size": HIDDEN,
                "num_hidden_layers": LAYERS,
                "num_local_experts": EXPERTS,
                "num_experts_per_tok": TOP_K,
            }
        )
    )
    dense: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": rng.random((32, HIDDEN)),
        "lm_head.weight": rng.random((32, HIDDEN)),
    }
    experts: dict[str, np.ndarray] = {}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        dense[p + "self_attn.q_proj.weight"] = rng.random((HIDDEN, HIDDEN))
        dense[p + "input_layernorm.weight"] = rng.random(HIDDEN)
        dense[p + "block_sparse_moe.gate.weight"] = rng.random((EXPERTS, HIDDEN))
        for e in range(EXPERTS):
            q = f"{p}block_sparse_moe.experts.{e}."
            experts[q + "w1.weight"] = rng.random((INTER, HIDDEN))
            experts[q + "w3.weight"] = rng.random((INTER, HIDDEN))
            experts[q + "w2.weight"] = rng.random((HIDDEN, INTER))
    dense = {k: v.astype(dtype) for k, v in dense.items()}
    experts = {k: v.astype(dtype) for k, v in experts.items()}
    names = sorted({**dense, **experts})
    half = len(names) // 2
    both = {**dense, **experts}
    save_file({k: both[k] for k in names[:half]}, str(path / "model-00001.safetensors"))
    save_file({k: both[k] for k in names[half:]}, str(path / "model-00002.safetensors"))
    return sum(v.nbytes for v in dense.values()), sum(v.nbytes for v in experts.values())


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, int]:
    path = tmp_path_factory.mktemp("plan") / "mixtral"
    dense, experts = _checkpoint(path)
    return path, dense, experts


def test_dense_and_expert_bytes_are_the_checkpoints(model: tuple[Path, int, int]) -> None:
    path, dense, experts = model
    m = model_bytes(str(path))
    assert (m.dense_bytes, m.expert_bytes) == (dense, experts)
    # A separate lm_head: a token reads one row of the input embedding, not the whole table.
    assert m.embedding_bytes == 32 * HIDDEN * 2
    g = m.geometry
    assert (g.n_layers, g.n_experts, g.top_k, g.hidden, g.moe_intermediate) == (
        LAYERS,
        EXPERTS,
        TOP_K,
        HIDDEN,
        INTER,
    )
    # f16 experts: three matrices of INTER x HIDDEN halves, each on a 256-byte boundary.
    assert m.pack.record_bytes == 3 * INTER * HIDDEN * 2
    assert m.pack.record_stride % 16384 == 0 and m.pack.record_stride >= m.pack.record_bytes
    assert [f.name for f in m.formats] == ["f16", "q8 g64", "q4 g64"]


def test_pack_sizes_are_the_packs_convert_writes(
    model: tuple[Path, int, int], tmp_path: Path
) -> None:
    path, _, _ = model
    m = model_bytes(str(path))
    for f in m.formats:
        quantize = None if f.converted_by == "convert" else f.converted_by.split()[-1]
        out = convert(
            path, tmp_path / f"{f.name.split()[0]}.strpk", progress=False, quantize=quantize
        )
        with ExpertPack.open(out) as pack:
            assert (pack.record_bytes, pack.record_stride) == (f.record_bytes, f.record_stride)
            # The metadata records the source path, so the file differs by its length only.
            assert abs(pack.file_bytes - f.pack_bytes) < 4096
            assert pack.records_offset + pack.geometry.n_records * pack.record_stride == (
                pack.file_bytes
            )


def test_the_arena_is_the_loaders_rule_on_the_real_pack(
    model: tuple[Path, int, int], tmp_path: Path
) -> None:
    path, dense, _ = model
    m = model_bytes(str(path))
    out = convert(path, tmp_path / "p.strpk", progress=False)
    with ExpertPack.open(out) as pack:
        for memory in (2 << 30, 3 << 30, 64 << 30):
            a = plan_arena(m.geometry, m.pack.record_stride, dense, memory)
            assert a.arena_bytes == arena_size(pack, None, available=memory - dense)
            assert a.slots == a.arena_bytes // pack.record_stride
        # Less than the rule's margin (64 MiB at least) left after the dense weights.
        too_small = plan_arena(m.geometry, m.pack.record_stride, dense, dense + (32 << 20))
        assert too_small.arena_bytes is None and "not enough memory" in (too_small.why or "")
        five = 5 * pack.record_stride
        requested = plan_arena(m.geometry, m.pack.record_stride, dense, None, five)
        assert requested.arena_bytes == arena_size(pack, five) and requested.slots == 5


def test_the_shipped_trace_is_the_test_datas_trace() -> None:
    shipped, original = read_trace(REFERENCE_TRACE), read_trace(DATA / "qwen3-30b-a3b.route.csv")
    assert shipped == original


def test_a_trace_of_another_geometry_is_replayed_at_the_same_share() -> None:
    trace = read_trace(REFERENCE_TRACE)  # 48 x 128, top-6: 6144 experts
    from strata_stream.pack.geometry import Geometry

    g = Geometry(4, 16, 2, 64, 64)  # 64 experts
    assert trace_slots(g, 16, trace) == (1536, True)  # a quarter of them
    assert trace_slots(g, 64, trace) == (6144, True)
    wide = Geometry(64, 256, 8, 64, 64)  # 16384 experts: 16 slots are 6 of the trace's
    assert trace_slots(wide, 16, trace) == (12, True)  # the replay's minimum, 2 x top-6
    same = Geometry(48, 128, 6, 64, 64)
    assert trace_slots(same, 1370, trace) == (1370, False)


def test_first_uses_are_left_out_of_the_hit_rate(tmp_path: Path) -> None:
    from strata_stream.pack.geometry import Geometry

    # Two layers of 4 experts, top-2: tokens alternate between two pairs in layer 0.
    rows = []
    for t in range(10):
        rows += [(t, 0, 2 * (t % 2)), (t, 0, 2 * (t % 2) + 1), (t, 1, 0), (t, 1, 1)]
    trace = write_strata_trace(tmp_path / "t.csv", 2, 4, 2, rows)
    g = Geometry(2, 4, 2, 8, 8)
    every = expected_hit_rate(g, 8, trace, cache_dir=tmp_path)
    assert (every.hit_rate, every.kind, every.scaled) == (1.0, "given", False)
    assert every.cold_hit_rate == pytest.approx(1 - 6 / 40)  # 6 distinct experts, 40 uses


def test_decode_speed_arithmetic() -> None:
    # Half the experts miss: 2 layers x top-2 x 0.5 = 2 records of 1000 bytes at 1000 B/s.
    s = decode_speed(0.5, 2, 2, 900, 1000, 0, Rate(1000.0, ""), Rate(1.0, ""), compute_tps=1.0)
    assert (s.misses_per_token, s.read_bytes_per_token) == (2.0, 2000.0)
    assert (s.io_ceiling, s.compute_ceiling) == (0.5, 1.0)
    assert (s.low, s.high) == pytest.approx((1 / 3, 0.5))
    # The low end at the cold hit rate: 2 layers x top-2 x 0.75 = 3 records, 3 s.
    s = decode_speed(
        0.5, 2, 2, 900, 1000, 0, Rate(1000.0, ""), Rate(1.0, ""), 1.0, cold_hit_rate=0.25
    )
    assert (s.low, s.high, s.misses_per_token_cold) == pytest.approx((1 / 4, 0.5, 3.0))
    assert s.io_ceiling_cold == pytest.approx(1 / 3)
    # With a lone record's latency: a layer missing m records waits one latency and m - 1
    # records streamed; a layer missing m < 1 misses at all in a share m of the tokens.
    slow = Rate(1000.0, "", latency_s=3.0)
    s = decode_speed(0.25, 2, 4, 900, 1000, 0, slow, Rate(1.0, ""), compute_tps=1.0)
    assert s.io_ceiling == pytest.approx(1 / (2 * (3.0 + 2 * 1.0)))  # m = 3 a layer
    s = decode_speed(0.75, 2, 2, 900, 1000, 0, slow, Rate(1.0, ""), compute_tps=1.0)
    assert s.io_ceiling == pytest.approx(1 / (2 * 0.5 * 3.0))  # m = 0.5 a layer
    # Estimated compute: dense bytes + every routed record, at the memory rate.
    s = decode_speed(1.0, 2, 2, 900, 1000, 400, Rate(1.0, ""), Rate(4000.0, ""))
    assert s.compute_bytes_per_token == 400 + 4 * 900 and s.compute_ceiling == 1.0
    assert math.isinf(s.io_ceiling) and s.low == s.high == 1.0


def _doctor(direct: float, buffered: float) -> DoctorResult:
    reading = [
        DiskReading("direct", 3 << 20, 4, int(direct * 1e9), 1.0),
        DiskReading("direct", 16384, 4, int(direct * 1e8), 1.0),
        DiskReading("buffered", 3 << 20, 4, int(buffered * 1e9), 1.0),
    ]
    return DoctorResult("/x", MemoryReport(None, 1, None, None), 7.0, tuple(reading))


def test_the_read_rate_is_the_mode_the_engine_would_read_in() -> None:
    doctor = _doctor(2.5, 0.5)
    gib = 1 << 30
    # A pack over a quarter of the memory is read direct: doctor's figure at its record size.
    assert read_rate(5 * gib, 16 * gib, 3 << 20, None, doctor).bytes_per_s == 2.5e9
    assert read_rate(5 * gib, 16 * gib, 16384, None, doctor).bytes_per_s == 2.5e8
    # One that fits stays in the page cache: doctor's cached reading, else memory speed.
    fits = read_rate(gib, 16 * gib, 3 << 20, None, doctor)
    assert fits.bytes_per_s == 7e9 and "page cache" in fits.source
    cached = DiskReading("cached", 3 << 20, 4, int(3e9), 1.0)
    doctor = DoctorResult("/x", doctor.memory, 7.0, (*doctor.disk, cached))
    assert read_rate(gib, 16 * gib, 3 << 20, None, doctor).bytes_per_s == 3e9
    assert read_rate(5 * gib, 16 * gib, 3 << 20, 1.5, doctor).bytes_per_s == 1.5e9
    nothing = read_rate(5 * gib, 16 * gib, 3 << 20, None, None)
    assert nothing.assumed and "assumed" in nothing.source


def test_an_arena_holding_every_expert_the_trace_uses_is_flagged(tmp_path: Path) -> None:
    from strata_stream.pack.geometry import Geometry

    g = Geometry(2, 8, 2, 8, 8)
    few = [(t, layer, e) for t in range(4) for layer in range(2) for e in (0, 1)]
    many = [(t, layer, e) for t in range(4) for layer in range(2) for e in (t, t + 4)]
    few_trace = write_strata_trace(tmp_path / "few.csv", 2, 8, 2, few)  # 4 experts used
    many_trace = write_strata_trace(tmp_path / "many.csv", 2, 8, 2, many)  # 16 used
    held = expected_hit_rate(g, 4, few_trace, cache_dir=tmp_path)
    assert (held.trace_experts_used, held.saturated, held.hit_rate) == (4, True, 1.0)
    evicting = expected_hit_rate(g, 4, many_trace, cache_dir=tmp_path)
    assert (evicting.trace_experts_used, evicting.saturated) == (16, False)


def test_plan_uses_a_trace_recorded_beside_the_cached_pack(
    model: tuple[Path, int, int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from strata_stream.convert.pack_cache import default_pack_path
    from strata_stream.plan.hit_rate import recorded_trace_path

    monkeypatch.setenv("STRATA_CACHE", str(tmp_path))
    path, _, _ = model
    p = make_plan(str(path), memory=8 << 30, use_saved_doctor=False)
    assert p.hit is not None and p.hit.kind == "reference" and p.hit.scaled
    recorded = recorded_trace_path(default_pack_path(path))
    recorded.parent.mkdir(parents=True)
    write_strata_trace(
        recorded,
        LAYERS,
        EXPERTS,
        TOP_K,
        [(t, layer, e) for t in range(3) for layer in range(LAYERS) for e in (t % 2, 2 + t % 2)],
    )
    p = make_plan(str(path), memory=8 << 30, use_saved_doctor=False)
    assert p.hit is not None and (p.hit.kind, p.hit.scaled) == ("recorded", False)


def test_the_hub_metadata_gives_the_local_figures(
    model: tuple[Path, int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hub path reads config.json and the shards' headers through huggingface_hub, offline
    here: its two calls answer from the local checkpoint."""
    hub = pytest.importorskip("huggingface_hub")
    from huggingface_hub.utils import SafetensorsFileMetadata, SafetensorsRepoMetadata, TensorInfo

    from strata_stream.convert.safetensors_index import SafetensorsIndex

    path, _, _ = model
    files: dict[str, Any] = {}
    with SafetensorsIndex(path) as index:
        for name, t in index.tensors.items():
            f = files.setdefault(t.file.name, {})
            f[name] = TensorInfo(t.dtype, list(t.shape), (t.offset, t.offset + t.nbytes))
    meta = SafetensorsRepoMetadata(
        None,
        True,
        {n: fn for fn, ts in files.items() for n in ts},
        {fn: SafetensorsFileMetadata({}, ts) for fn, ts in files.items()},
    )
    monkeypatch.setattr(hub, "get_safetensors_metadata", lambda repo: meta)
    monkeypatch.setattr(hub, "hf_hub_download", lambda repo, name: str(path / name))
    local, remote = model_bytes(str(path)), model_bytes("someone/mixtral-tiny")
    assert (remote.dense_bytes, remote.expert_bytes, remote.formats) == (
        local.dense_bytes,
        local.expert_bytes,
        local.formats,
    )


def test_plan_prints_every_figure_and_json(
    model: tuple[Path, int, int], capsys: pytest.CaptureFixture[str]
) -> None:
    path, dense, experts = model
    assert main(["plan", str(path), "--memory", "8GB", "--disk-gbps", "2"]) == 0
    text = capsys.readouterr().out
    for label in (
        "dense bytes",
        "expert bytes",
        "arena",
        "hit rate",
        "IO ceiling",
        "compute ceiling",
        "decode",
    ):
        assert label in text
    assert "shipped Qwen3-30B-A3B trace" in text
    assert "assumed" in text  # no doctor result saved in this test's cache
    assert main(["plan", str(path), "--memory", "8GB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["dense_bytes"], out["expert_bytes"]) == (dense, experts)
    low, high = out["decode"]["predicted_tps"]
    assert 0 < low <= high


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--memory", "lots"], "--memory"),
        (["--memory", "0"], "--memory must be"),
        (["--disk-gbps", "0"], "--disk-gbps must be"),
        (["--compute-tps", "nan"], "--compute-tps must be"),
        (["--memory", "8GB", "--arena-gb", "1"], "give one"),
        (["--trace", "/no/such/trace.csv"], "no such file"),
    ],
)
def test_plan_mistakes_are_one_line(
    model: tuple[Path, int, int], argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path, _, _ = model
    assert main(["plan", str(path), *argv]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1 and "Traceback" not in err


def test_plan_of_what_is_not_a_model_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", str(tmp_path / "absent")]) == 2
    assert "no such model directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["plan", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
