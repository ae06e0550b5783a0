"""`strata-stream doctor`: what it reads of memory, that its disk passes read what they say,
and that plan finds what it saved."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from strata_stream import container_memory
from strata_stream.cli import main
from strata_stream.doctor import disk, saved
from strata_stream.doctor.disk import parts_of, read_pass
from strata_stream.doctor.memory import memory_report
from strata_stream.pack.header import PAGE


@pytest.fixture
def small(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """doctor over a 2 MiB file in two record sizes, saving into a cache of the test's own."""
    monkeypatch.setattr(disk, "FILE_BYTES", 2 << 20)
    monkeypatch.setattr(disk, "RECORD_SIZES", (PAGE, 256 << 10))
    monkeypatch.setattr(disk, "PASS_SECONDS", 30.0)  # every record: the byte count is exact
    monkeypatch.setenv("STRATA_CACHE", str(tmp_path / "cache"))
    return tmp_path


@pytest.mark.parametrize("record", [PAGE, 3 * PAGE + 100, 256 << 10, (3 << 20) + 5])
def test_parts_cover_the_record_in_whole_pages(record: int) -> None:
    parts = parts_of(record, 256 << 10)
    assert parts[0][0] == 0
    assert all(a + n == b for (a, n), (b, _) in zip(parts, parts[1:], strict=False))
    end = parts[-1][0] + parts[-1][1]
    assert end >= record and end % PAGE == 0 and end - record < PAGE
    assert all(n % PAGE == 0 and n <= 256 << 10 for _, n in parts)


@pytest.mark.parametrize("mode", ["direct", "buffered", "cached"])
def test_a_pass_reads_every_record_once(small: Path, mode: str) -> None:
    path = small / "f"
    disk._write_file(path, 1 << 20)
    r = read_pass(path, mode, 3 * PAGE, 3, 1 << 20, 256 << 10, 30.0)
    records = (1 << 20) // (3 * PAGE)  # 21 whole records of 48 KiB in 1 MiB
    assert (r.mode, r.threads, r.bytes_read) == (mode, 3, records * 3 * PAGE)
    assert r.gbps > 0


@pytest.mark.parametrize("mode", ["direct", "cached"])
def test_a_lone_record_latency_is_a_positive_median(small: Path, mode: str) -> None:
    path = small / "f"
    disk._write_file(path, 1 << 20)
    lat = disk.lone_latency(path, mode, 5 * PAGE, 2, 1 << 20, 2 * PAGE, 30.0)
    assert 0 < lat < 30.0


def test_memory_is_the_meminfo_and_the_containers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fake /proc/meminfo (10 GiB available) and a cgroup v2 limit of 4 GiB using 1 GiB, of
    which 256 MiB is page cache the kernel drops first: 3.25 GiB is what the process can have."""
    from strata_stream import arena_budget

    gib = 1 << 30
    (tmp_path / "meminfo").write_text(f"MemAvailable: {10 * gib // 1024} kB\n")
    root = tmp_path / "cgroup" / "box"
    root.mkdir(parents=True)
    (root / "memory.max").write_text(f"{4 * gib}\n")
    (root / "memory.current").write_text(f"{gib}\n")
    (root / "memory.stat").write_text(f"inactive_file {256 << 20}\n")
    (tmp_path / "proc_cgroup").write_text("0::/box\n")
    monkeypatch.setattr(arena_budget, "MEMINFO", str(tmp_path / "meminfo"))
    monkeypatch.setattr(container_memory, "CGROUP_ROOT", str(tmp_path / "cgroup"))
    monkeypatch.setattr(container_memory, "PROC_CGROUP", str(tmp_path / "proc_cgroup"))
    m = memory_report()
    left = 4 * gib - (gib - (256 << 20))
    assert (m.container_limit, m.container_left, m.available) == (4 * gib, left, left)
    assert m.total == os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def test_doctor_measures_saves_and_plan_reads_it(
    small: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["doctor", "--path", str(small), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {(r["mode"], r["record_bytes"], r["threads"]) for r in out["disk"]}
    threads = disk.io_thread_counts()
    want = {(m, s, t) for m in disk.MODES for s in (PAGE, 256 << 10) for t in threads}
    refused = any("direct reads refused" in n for n in out["notes"])
    assert rows == ({w for w in want if w[0] != "direct"} if refused else want)
    for r in out["disk"]:
        assert r["bytes_read"] == (2 << 20) // r["record_bytes"] * r["record_bytes"]
    assert not list(small.glob(".strata-doctor-*"))  # its file is gone
    back = saved.load_result()
    assert back is not None and back.to_json() == {k: v for k, v in out.items() if k != "saved"}
    assert Path(out["saved"]) == saved.result_path()


def test_direct_reads_refused_are_a_note_not_an_error(
    small: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = disk._open

    def no_direct(path: Path, mode: str) -> int:
        if mode == "direct":
            raise OSError(22, "Invalid argument")
        return real(path, mode)

    monkeypatch.setattr(disk, "_open", no_direct)
    readings, notes = disk.measure_disk(small, progress=False)
    assert {r.mode for r in readings} == {"buffered", "cached"}
    assert len(notes) == 1 and "direct reads refused" in notes[0]


def test_a_damaged_saved_result_is_no_result(small: Path) -> None:
    saved.result_path().parent.mkdir(parents=True)
    saved.result_path().write_text("{not json")
    assert saved.load_result() is None
    saved.result_path().write_text(json.dumps({"format": "something else"}))
    assert saved.load_result() is None


def test_doctor_mistakes_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--path", str(tmp_path / "absent")]) == 2
    err = capsys.readouterr().err
    assert "no such directory" in err and err.count("\n") == 1
    assert main(["doctor", "--path", "/proc", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "cannot write" in err and err.count("\n") == 1
