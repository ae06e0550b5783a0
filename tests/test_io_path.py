"""The IO path from Python: record checksums (CRC32C) against a pack that changes on disk."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import PackFactory, random_turns
from strata_stream import ExpertPack, ExpertStream, StreamConfig, Window, testing
from strata_stream.errors import ExpertReadError

L, E, K, H, INTER = 4, 16, 4, 64, 48


def _copy(make_pack: PackFactory, tmp_path: Path) -> Path:
    src = make_pack(n_layers=L, n_experts=E, top_k=K, hidden=H, moe_intermediate=INTER)
    return Path(shutil.copy(src, tmp_path / "changing.strpk"))


def _config(path: Path, **kw: object) -> StreamConfig:
    with ExpertPack.open(path) as p:
        arena = p.geometry.n_layers * p.geometry.n_experts * p.record_stride
    # Everything else (verify_reads included) at its default: the user's scenario.
    base: dict[str, object] = dict(arena_bytes=arena, io_threads=2, persist_profile=False)
    base.update(kw)
    return StreamConfig(**base)  # type: ignore[arg-type]


def test_verify_reads_is_on_by_default() -> None:
    assert StreamConfig().verify_reads is True
    assert StreamConfig.from_env({}).verify_reads is True
    assert StreamConfig.from_env({"STRATA_VERIFY_READS": "0"}).verify_reads is False


def test_truncated_then_regrown_with_zeros_while_open_raises_not_computes(
    make_pack: PackFactory, tmp_path: Path
) -> None:
    """The pack is truncated, then grown back with zeros, while a stream is open: the truncation
    is a short read, and the zeroed records now fail their CRC32C instead of being computed with."""
    path = _copy(make_pack, tmp_path)
    with ExpertPack.open(path) as p:
        size = p.file_bytes
        cut = p.record_offset(2, 0)
        bad = p.record_offset(3, 1)
    with ExpertStream(path, _config(path)) as stream:
        testing.wait(stream, 0, [0, 1])
        os.truncate(path, cut)
        with pytest.raises(ExpertReadError, match=r"layer 3 expert 1 at file offset \d+ .*short"):
            testing.wait(stream, 3, [1])
        os.truncate(path, size)  # grown back: every record from layer 2 on is zeros
        with pytest.raises(ExpertReadError) as info:
            testing.wait(stream, 3, [1])
        msg = str(info.value)
        assert f"layer 3 expert 1 at file offset {bad} of {path}" in msg
        assert "CRC32C" in msg
        testing.wait(stream, 1, [5])  # records the change left alone still read
        assert testing.check_invariants(stream) == ""


def test_a_window_over_zeroed_records_raises_instead_of_returning_wrong_output(
    make_pack: PackFactory, tmp_path: Path
) -> None:
    path = _copy(make_pack, tmp_path)
    xs = random_turns(3, [2], L, H)[0]
    with ExpertPack.open(path) as p:
        size = p.file_bytes
        cut = p.record_offset(1, 0)
    with ExpertStream(path, _config(path)) as stream, Window(stream) as w:
        os.truncate(path, cut)
        os.truncate(path, size)  # layers 1..3 are zeros now; nothing of them was read yet
        with pytest.raises(ExpertReadError, match=re.escape("CRC32C")), w.turn():
            for layer, x in enumerate(xs):
                out = w.moe(layer, x)
                assert np.isfinite(out).all()


def test_verify_off_is_still_available_and_reads_what_the_disk_holds(
    make_pack: PackFactory, tmp_path: Path
) -> None:
    # The opt-out exists for a pack the user knows is sound: it then reads what is on disk,
    # unchecked (this is the silent case verification by default prevents).
    path = _copy(make_pack, tmp_path)
    with ExpertPack.open(path) as p:
        size = p.file_bytes
        cut = p.record_offset(3, 0)
    with ExpertStream(path, _config(path, verify_reads=False)) as stream:
        os.truncate(path, cut)
        os.truncate(path, size)
        testing.wait(stream, 3, [2])
        data = stream.expert_bytes(3, 2)
        assert data is not None and not np.asarray(data).any()


@pytest.mark.parametrize("verify", [True, False])
def test_the_io_threads_time_splits_into_read_checksum_observers_and_the_rest(
    make_pack: PackFactory, tmp_path: Path, verify: bool
) -> None:
    """benchmarks/io_path.py reads these counters: each piece is a part of the jobs' time, and the
    checksum counts only when reads are verified."""
    path = _copy(make_pack, tmp_path)
    with ExpertStream(path, _config(path, verify_reads=verify)) as stream, Window(stream):
        for layer in range(L):
            testing.wait(stream, layer, list(range(E)))
        st = stream.stats()
    assert st["reads_completed"] == L * E
    pieces = st["read_seconds"] + st["crc_seconds"] + st["observer_seconds"]
    assert 0 < pieces <= st["io_job_seconds"]
    assert st["io_job_cpu_seconds"] > 0
    assert (st["crc_seconds"] > 0) == verify


def test_the_raw_reference_reads_every_part_into_either_destination(
    make_pack: PackFactory, tmp_path: Path
) -> None:
    # Not installed (benchmarks/bench_ext.py builds it on demand); a build with
    # STRATA_BUILD_BENCH=ON has it.
    _bench = pytest.importorskip("strata_stream._bench", reason="built with STRATA_BUILD_BENCH")
    path = _copy(make_pack, tmp_path)
    with ExpertPack.open(path) as p:
        n, stride, span = L * E, p.record_stride, -(-p.record_bytes // 4096) * 4096
    for dest in (0, n * stride, 3 * stride):  # staging buffers, an arena, a smaller one
        for crc in (False, True):
            r = _bench.bench_raw_read(str(path), 0, n, 4096, 2, dest, False, crc)
            assert r["bytes"] == n * span and r["seconds"] > 0
