"""ExpertStream through its Python API: residency, publication, errors, stats."""

from __future__ import annotations

import dataclasses
import mmap
import os
import shutil
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

from conftest import PackFactory, record_bytes_of
from strata_stream import ExpertStream, ReadClass, StreamConfig, _core, testing
from strata_stream.errors import (
    ArenaFullError,
    ConfigError,
    ExpertReadError,
    PackError,
    StreamClosedError,
)
from strata_stream.pack import Geometry
from strata_stream.pack.header import build_header, record_crc
from strata_stream.stream import ABSENT


def config(n_slots: int, stride: int, **kw: object) -> StreamConfig:
    base = dict(arena_bytes=n_slots * stride, io_threads=2, part_bytes=16384, direct_io=False)
    base.update(kw)
    return StreamConfig(**base)  # type: ignore[arg-type]


def stride_of(path: object) -> int:
    from strata_stream import ExpertPack

    with ExpertPack.open(path) as p:  # type: ignore[arg-type]
        return p.record_stride


def test_urgent_request_reads_the_records(make_pack: PackFactory) -> None:
    path = make_pack()
    with ExpertStream(path, config(8, stride_of(path))) as s:
        assert testing.request(s, 1, [3, 9]) == (0, 2, 0)
        testing.wait(s, 1, [3, 9])
        layout = s._s.layout
        for e in (3, 9):
            got = s.expert_bytes(1, e)
            assert got is not None
            assert got.tobytes() == record_bytes_of(path, layout, testing.key(s, 1, e))
        assert testing.request(s, 1, [3]) == (1, 0, 0)
        st = s.stats()
        assert st["misses"] == 2 and st["hits"] == 1
        assert st["bytes_read"] >= 2 * s._s.layout["record_bytes"]
        assert testing.check_invariants(s) == ""


def test_stats_split_each_miss_into_its_phases(make_pack: PackFactory) -> None:
    """Every miss urgent from its start is timed once, its phases (queued, reads, CRC and
    observers, publication) inside the waits that covered it; a hit and a speculative read,
    even one an urgent wait then took over, add nothing."""
    path = make_pack()
    with ExpertStream(path, config(8, stride_of(path))) as s:
        t0 = time.perf_counter()
        testing.request(s, 1, [3, 9])
        testing.wait(s, 1, [3, 9])
        waited = time.perf_counter() - t0
        testing.wait(s, 1, [3])  # a hit
        testing.enter_layer(s, 1)
        testing.request(s, 2, [4], urgent=False)
        testing.wait(s, 2, [4])  # the speculative read, taken over by an urgent wait (promoted)
        st = s.stats()
        assert st["misses"] == 2 and st["miss_timed"] == 2
        phases = [st[f"miss_{p}_seconds"] for p in ("queued", "read", "finish", "publish")]
        assert all(v >= 0.0 for v in phases)
        # Two misses read side by side: each phase sum is at most both misses' whole span.
        assert sum(phases) <= 2 * waited


def test_records_are_read_in_parts_balanced_over_the_io_threads(make_pack: PackFactory) -> None:
    # 768 KiB records with parts of at most 256 KiB over 4 threads: 4 equal parts of 192 KiB
    # (not 3 of 256 KiB, which leave a thread idle), every record still read whole and verified.
    path = make_pack(n_layers=2, n_experts=4, hidden=256, moe_intermediate=256)
    stride = stride_of(path)
    cfg = config(8, stride, io_threads=4, part_bytes=256 << 10, verify_reads=True)
    with ExpertStream(path, cfg) as s:
        assert s._s.layout["record_bytes"] == 3 * 256 * 256 * 4
        assert (testing.n_parts(s), testing.part_bytes(s)) == (4, 192 << 10)
        for layer in range(2):
            testing.request(s, layer, [0, 1, 2, 3])
            testing.wait(s, layer, [0, 1, 2, 3])
            for e in range(4):
                got = s.expert_bytes(layer, e)
                assert got is not None
                assert got.tobytes() == record_bytes_of(path, s._s.layout, testing.key(s, layer, e))
        assert testing.check_invariants(s) == ""
    with ExpertStream(path, dataclasses.replace(cfg, io_threads=1)) as s:
        assert (testing.n_parts(s), testing.part_bytes(s)) == (
            3,
            256 << 10,
        )  # one thread: the cap's count


def test_spinning_io_reads_the_same_records_and_closes_promptly(make_pack: PackFactory) -> None:
    # io_spin_us: idle IO threads and urgent waits poll before they sleep; what they read and
    # when a stream closes must not change (the spin is bounded and re-checked under the lock).
    path = make_pack()
    cfg = config(8, stride_of(path), io_spin_us=2000, verify_reads=True)
    s = ExpertStream(path, cfg)
    layout = s._s.layout
    for layer in range(4):
        for pair in ([1, 2], [3, 4], [1, 5]):
            testing.request(s, layer, pair)
            testing.wait(s, layer, pair)
            for e in pair:
                got = s.expert_bytes(layer, e)
                assert got is not None
                assert got.tobytes() == record_bytes_of(path, layout, testing.key(s, layer, e))
    assert testing.check_invariants(s) == ""
    s.close()  # joins the IO threads: one mid-spin notices the close within io_spin_us
    assert s.closed
    with pytest.raises(ConfigError, match="io_spin_us"):
        config(8, stride_of(path), io_spin_us=-1)


def test_smap_is_a_read_only_view(make_pack: PackFactory) -> None:
    path = make_pack()
    with ExpertStream(path, config(8, stride_of(path))) as s:
        view = testing.smap(s)
        assert view.dtype == np.uint32 and view.shape == (s.n_layers * s.n_experts,)
        assert (view == ABSENT).all()
        with pytest.raises(ValueError):
            view[0] = 1
        testing.wait(s, 0, [5])
        assert view[testing.key(s, 0, 5)] != ABSENT  # a live view, not a copy


def test_every_expert_through_a_small_arena(make_pack: PackFactory) -> None:
    path = make_pack(n_layers=3, n_experts=8)
    with ExpertStream(path, config(4, stride_of(path), io_threads=3)) as s:
        layout = s._s.layout
        for layer in range(3):  # no layer protection: same-layer experts evict each other
            for e in range(0, 8, 2):
                testing.wait(s, layer, [e, e + 1])
                for x in (e, e + 1):
                    got = s.expert_bytes(layer, x)
                    assert got is not None
                    assert got.tobytes() == record_bytes_of(path, layout, testing.key(s, layer, x))
                assert testing.check_invariants(s) == ""
        assert s.stats()["evicted"] > 0


def test_arena_too_small_names_the_minimum(make_pack: PackFactory) -> None:
    path = make_pack(top_k=2)
    with pytest.raises(ConfigError, match="at least 4 slots"):
        ExpertStream(path, config(3, stride_of(path)))


def test_urgent_request_larger_than_the_unprotected_arena(make_pack: PackFactory) -> None:
    path = make_pack()
    with ExpertStream(path, config(4, stride_of(path))) as s:
        testing.enter_layer(s, 0)
        with pytest.raises(ArenaFullError, match="no arena slot"):
            testing.request(s, 0, [0, 1, 2, 3, 4])
        testing.end_turn(s)
        testing.wait(s, 0, [0, 1])  # still usable


def test_an_urgent_request_never_evicts_an_expert_it_holds(make_pack: PackFactory) -> None:
    """Expert 6 of layer 2 is resident and unprotected; the request for (6, 0) must not make room
    for 0 by evicting 6, which it has just counted as a hit. With every other slot protected or
    loading there is no room: ArenaFullError, and 6 stays."""
    path = make_pack()
    with ExpertStream(path, config(4, stride_of(path), io_threads=0)) as s:
        testing.request(s, 0, [0])
        testing.request(s, 1, [0])
        testing.request(s, 2, [6])
        while testing.run_io(s):
            pass
        testing.request(s, 0, [1])  # the fourth slot: an urgent read left queued
        testing.enter_layer(s, 0)  # layer 0 executing, every slot of it protected
        testing.after_layer(s, 0)  # layer 1 protected for its router
        with pytest.raises(ArenaFullError):
            testing.request(s, 2, [6, 0])
        assert testing.where(s, 2, 6) is not None
        assert testing.check_invariants(s) == ""


def test_bad_arguments_raise_clear_errors(make_pack: PackFactory) -> None:
    path = make_pack()
    with ExpertStream(path, config(8, stride_of(path))) as s:
        with pytest.raises(IndexError, match="layer 4 out of range"):
            testing.request(s, 4, [0])
        with pytest.raises(IndexError, match="expert 16 out of range"):
            testing.request(s, 0, [16])
        with pytest.raises(IndexError, match="expert 4294967299 out of range"):
            testing.request(s, 0, [2**32 + 3])  # not expert 3 after an int32 wrap
        with pytest.raises(TypeError, match="integers"):
            testing.request(s, 0, [1.5])
        with pytest.raises(ValueError, match="1-D"):
            testing.request(s, 0, [[1, 2]])
        with pytest.raises(ValueError, match="contradicts"):
            testing.request(s, 0, [1], urgent=True, cls=ReadClass.PRED1)
        with pytest.raises(ValueError, match="fault kind"):
            testing.inject_fault(s, 0, 1, kind="boom")
        testing.wait(s, 0, [1])


def test_core_key_and_where_range_check_layer_and_expert(make_pack: PackFactory) -> None:
    """The engine checks (layer, expert) itself: an expert past n_experts must not alias the next
    layer's key, whoever calls it (here _core directly, below the Python wrapper's checks)."""
    path = make_pack()  # 4 layers x 16 experts
    with ExpertStream(path, config(8, stride_of(path))) as s:
        core = s._s
        key, where = _core.testing.key, _core.testing.where
        assert key(core, 1, 3) == 19 and where(core, 1, 3) == -1
        testing.wait(s, 1, [3])
        assert where(core, 1, 3) == testing.where(s, 1, 3) is not None
        for layer, expert, what in [
            (0, 16, "expert 16 out of range"),  # would alias (1, 0)
            (0, -1, "expert -1 out of range"),
            (1, 1 << 33, "expert 8589934592 out of range"),
            (4, 0, "layer 4 out of range"),
            (-1, 3, "layer -1 out of range"),
        ]:
            for call in (key, where):
                with pytest.raises(ConfigError, match=what):
                    call(core, layer, expert)
        with pytest.raises(IndexError, match="expert 16 out of range"):
            testing.where(s, 0, 16)
        with pytest.raises(IndexError, match="expert 16 out of range"):
            testing.key(s, 0, 16)


def test_closed_stream_raises(make_pack: PackFactory) -> None:
    path = make_pack()
    s = ExpertStream(path, config(8, stride_of(path)))
    s.close()
    s.close()  # idempotent
    assert s.closed
    with pytest.raises(StreamClosedError):
        testing.request(s, 0, [1])


def test_missing_and_corrupt_pack(make_pack: PackFactory, tmp_path: object) -> None:
    with pytest.raises(PackError, match="cannot open"):
        ExpertStream("/nonexistent/pack.strpk", StreamConfig())
    bad = tmp_path / "bad.strpk"  # type: ignore[operator]
    bad.write_bytes(b"NOTAPACK" + bytes(8000))
    with pytest.raises(PackError, match="bad magic"):
        ExpertStream(bad, StreamConfig())


@pytest.mark.parametrize("kind", ["eio", "short"])
def test_urgent_read_failure_names_layer_expert_offset_errno(
    make_pack: PackFactory, kind: str
) -> None:
    path = make_pack()
    with ExpertStream(path, config(8, stride_of(path))) as s:
        testing.inject_fault(s, 2, 7, part=1, kind=kind)
        with pytest.raises(ExpertReadError) as info:
            testing.wait(s, 2, [7])
        err = info.value
        assert err.layer == 2 and err.expert == 7  # type: ignore[attr-defined]
        layout = s._s.layout
        assert (
            err.offset == layout["records_offset"] + testing.key(s, 2, 7) * s.record_stride + 16384
        )  # type: ignore[attr-defined]
        assert err.errno == (5 if kind == "eio" else 0)
        assert f"layer 2 expert 7 at file offset {err.offset}" in str(err)  # type: ignore[attr-defined]
        assert testing.where(s, 2, 7) is None
        assert s.stats()["failed"] == 1
        testing.wait(s, 2, [7])  # one-shot fault: the retry reads it
        got = s.expert_bytes(2, 7)
        assert got is not None and got.tobytes() == record_bytes_of(
            path, layout, testing.key(s, 2, 7)
        )
        assert testing.check_invariants(s) == ""


def test_speculative_failure_is_dropped_and_counted(make_pack: PackFactory) -> None:
    path = make_pack()
    with ExpertStream(path, config(8, stride_of(path), io_threads=0)) as s:
        testing.inject_fault(s, 1, 4, kind="eio")
        testing.request(s, 1, [4], urgent=False)
        while testing.run_io(s, 0):
            pass
        assert s.stats()["spec_failed"] == 1
        assert testing.where(s, 1, 4) is None
        testing.wait(s, 1, [4])
        assert s.expert_bytes(1, 4) is not None


@pytest.mark.parametrize("where", ["first byte", "second part", "last part", "last byte"])
def test_checksum_mismatch_on_read(make_pack: PackFactory, tmp_path: object, where: str) -> None:
    # Each part's CRC is taken by the thread that read it and the record's check combines them
    # in order (16 KiB parts here: three a record), so a flip in any part must show.
    import shutil

    src = make_pack()
    path = tmp_path / "flipped.strpk"  # type: ignore[operator]
    shutil.copy(src, path)
    stride = stride_of(path)
    with ExpertStream(path, config(8, stride)) as s:
        record_bytes = s._s.layout["record_bytes"]
        assert record_bytes > 2 * 16384, "the pack's records must span several 16 KiB parts"
        at = {"first byte": 0, "second part": 16384 + 17, "last part": record_bytes - 100,
              "last byte": record_bytes - 1}[where]  # fmt: skip
        off = s._s.layout["records_offset"] + testing.key(s, 1, 2) * stride + at
    with ExpertStream(path, config(8, stride, part_bytes=16384, verify_reads=True)) as s:
        testing.wait(s, 1, [2])  # the parts' CRCs combine to the record's
    with open(path, "r+b") as f:
        f.seek(off)
        byte = f.read(1)
        f.seek(off)
        f.write(bytes([byte[0] ^ 0xFF]))
    with ExpertStream(path, config(8, stride, part_bytes=16384, verify_reads=True)) as s:
        with pytest.raises(ExpertReadError, match="checksum mismatch"):
            testing.wait(s, 1, [2])
        testing.wait(s, 1, [3])  # other records still fine


def test_direct_io_is_reported(make_pack: PackFactory) -> None:
    path = make_pack()
    with ExpertStream(path, config(8, stride_of(path), direct_io=True)) as s:
        assert isinstance(s.direct_io, bool)
        if not s.direct_io:
            assert "O_DIRECT" in s.direct_note
        testing.wait(s, 0, [0, 1])
        assert s.stats()["direct_io"] == s.direct_io


def test_a_small_pack_is_read_through_the_page_cache_by_default(make_pack: PackFactory) -> None:
    path = make_pack()
    with ExpertStream(path, config(8, stride_of(path), direct_io=None)) as s:
        assert s.config.direct_io is None
        assert s.direct_io is False
        assert "direct_io auto" in s.direct_note
        testing.wait(s, 0, [0, 1])
        assert s.stats()["direct_io"] is False


def test_a_stuck_read_times_out_and_the_stream_recovers(make_pack: PackFactory) -> None:
    import time

    from strata_stream.errors import StreamTimeoutError

    path = make_pack()
    with ExpertStream(path, config(8, stride_of(path), io_timeout_s=0.2)) as s:
        testing.inject_fault(s, 0, 3, part=0, kind="delay", delay_s=1.0)
        with pytest.raises(StreamTimeoutError, match="no read progress"):
            testing.wait(s, 0, [3])
        testing.wait(s, 0, [4])  # other reads go on; the slow one lands eventually
        time.sleep(1.0)
        testing.wait(s, 0, [3])
        assert testing.check_invariants(s) == ""


def test_ctrl_c_interrupts_a_wait(make_pack: PackFactory) -> None:
    import os
    import signal
    import threading
    import time

    path = make_pack()
    with ExpertStream(path, config(8, stride_of(path))) as s:
        testing.inject_fault(s, 1, 2, part=0, kind="delay", delay_s=1.5)
        # A shell that starts pytest in the background (`cmd &`) hands it SIGINT ignored, and
        # Python then never raises KeyboardInterrupt: install Python's own handler for the test.
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT))
        try:
            timer.start()
            t0 = time.monotonic()
            with pytest.raises(KeyboardInterrupt):
                testing.wait(s, 1, [2])
            assert time.monotonic() - t0 < 1.4  # interrupted, not waited out
        finally:
            timer.cancel()
            signal.signal(signal.SIGINT, previous)
        timer.join()
        testing.wait(s, 1, [2])
        assert testing.check_invariants(s) == ""


def test_demo_streams_the_tiny_preset(tmp_path: object) -> None:
    from strata_stream.demo import main

    pack = tmp_path / "tiny.strpk"  # type: ignore[operator]
    assert main(["--preset", "tiny", "--pack", str(pack), "--prompt", "40", "--decode", "3"]) == 0
    assert pack.exists()


# ---- O_DIRECT and large offsets --------------------------------------------------------------


def _o_direct_refusal(directory: Path) -> str | None:
    """None when `directory`'s file system serves aligned O_DIRECT reads, else why not."""
    if not hasattr(os, "O_DIRECT"):
        return "this platform has no O_DIRECT"
    probe = directory / ".o_direct_probe"
    probe.write_bytes(bytes(8192))
    try:
        try:
            fd = os.open(probe, os.O_RDONLY | os.O_DIRECT)
        except OSError as e:
            return f"{directory} refuses open(O_DIRECT): {e.strerror}"
        try:
            os.preadv(fd, [mmap.mmap(-1, 4096)], 4096)  # page-aligned buffer, offset and length
        except OSError as e:
            return f"{directory} refuses an aligned O_DIRECT read: {e.strerror}"
        finally:
            os.close(fd)
    finally:
        probe.unlink()
    return None


@pytest.fixture
def direct_dir(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory whose file system allows O_DIRECT (pytest's tmp, else /var/tmp); the test
    is skipped, with each refusal's reason, only when none does."""
    reasons = []
    for d in (tmp_path, Path("/var/tmp")):
        if d.is_dir() and os.access(d, os.W_OK):
            why = _o_direct_refusal(d)
            if why is None:
                return d if d == tmp_path else Path(tempfile.mkdtemp(dir=d))
            reasons.append(why)
    pytest.skip("; ".join(reasons) or "no writable directory to probe O_DIRECT in")


def test_direct_io_reads_every_record_exactly(make_pack: PackFactory, direct_dir: Path) -> None:
    """With O_DIRECT really on, every part read is aligned (a misaligned one fails EINVAL and
    would surface as ExpertReadError): records whose length is not a multiple of 4096 read
    through their padded tail, each byte equal to the file's, crc-verified."""
    # f16 64 x 34: tensors of 17 x 256 bytes, so the record (13056 bytes) ends off any 512-byte
    # sector: only the engine's rounding of the read up to 4096 keeps O_DIRECT aligned.
    src = make_pack(
        n_layers=2, n_experts=8, top_k=2, hidden=64, moe_intermediate=34, weight_format="f16"
    )
    path = Path(shutil.copy(src, direct_dir / "direct.strpk"))
    stride = stride_of(path)
    with ExpertStream(path, config(4, stride, direct_io=True, verify_reads=True)) as s:
        assert s.direct_io, (
            f"O_DIRECT works in {direct_dir} but the stream fell back: {s.direct_note}"
        )
        assert s._s.layout["record_bytes"] % 512 != 0  # a partial last sector
        layout = s._s.layout
        for layer in range(2):
            for e in range(8):
                testing.wait(s, layer, [e])
                got = s.expert_bytes(layer, e)
                assert got is not None
                assert got.tobytes() == record_bytes_of(path, layout, testing.key(s, layer, e))
        assert s.stats()["failed"] == 0
        assert testing.check_invariants(s) == ""


def _sparse_pack_past_4_gib(directory: Path) -> tuple[Path, dict[int, bytes]]:
    """A valid f32 pack of 4.7 GiB whose records are holes (zeros) except a few written past
    4 GiB, one of them straddling 2^32. Returns the path and {key: record bytes written}."""
    g = Geometry(4, 800, 2, 256, 512, "softmax_topk", True)  # 1.5 MiB records, 3200 of them
    header, blob = build_header(g, "f32", 0, None, "test", "sparse past 4 GiB")
    router_crc = zlib.crc32(bytes(header.router_bytes))  # the router section is a hole
    header = dataclasses.replace(header, router_crc=router_crc)
    assert header.file_bytes > 4 << 30
    straddle = next(
        k for k in range(g.n_records)
        if header.records_offset + k * header.record_stride < 1 << 32
        < header.records_offset + k * header.record_stride + header.record_bytes
    )  # fmt: skip
    keys = [straddle, straddle + 1, g.n_records - 5, g.n_records - 1]
    rng = np.random.default_rng(7)
    written = {k: rng.integers(0, 256, header.record_bytes, dtype=np.uint8).tobytes() for k in keys}
    zero_crc = record_crc(bytes(header.record_bytes))
    crcs = np.full(g.n_records, zero_crc, dtype="<u4")
    for k, rec in written.items():
        crcs[k] = record_crc(rec)
    path = directory / "sparse.strpk"
    with open(path, "wb") as f:
        f.write(header.to_bytes())
        f.write(blob)
        f.seek(header.checksum_offset)
        f.write(crcs.tobytes())
        for k, rec in written.items():
            f.seek(header.records_offset + k * header.record_stride)
            f.write(rec)
        f.truncate(header.file_bytes)
    return path, written


@pytest.mark.parametrize("direct_io", [False, True])
def test_records_past_4_gib_read_right(tmp_path: Path, direct_io: bool) -> None:
    """Offsets above 2^32 (a sparse 4.7 GiB pack): the bytes read are the bytes written, with
    buffered and with O_DIRECT reads; a hole reads as the zeros its checksum says."""
    directory = tmp_path
    if direct_io:
        why = _o_direct_refusal(tmp_path)
        if why is not None:
            pytest.skip(why)
    path, written = _sparse_pack_past_4_gib(directory)
    stride = stride_of(path)
    with ExpertStream(path, config(4, stride, direct_io=direct_io, verify_reads=True)) as s:
        assert s.direct_io == direct_io, s.direct_note
        layout = s._s.layout
        for key, rec in written.items():
            layer, expert = divmod(key, s.n_experts)
            assert layout["records_offset"] + key * stride + len(rec) > 1 << 32
            testing.wait(s, layer, [expert])
            got = s.expert_bytes(layer, expert)
            assert got is not None and got.tobytes() == rec
        testing.wait(s, 3, [100])  # a hole past 4 GiB: zeros, crc-verified
        hole = s.expert_bytes(3, 100)
        assert hole is not None and not hole.any()
        assert s.stats()["failed"] == 0
