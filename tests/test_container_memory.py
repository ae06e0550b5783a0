"""An arena sized from free memory stays inside a container's memory limit (cgroup v2 and v1),
whatever the machine has free: a cgroup's processes are killed at its limit. The cgroup files
here are fakes under tmp_path, with a /proc/self/cgroup and a /proc/meminfo of their own."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import PackFactory
from strata_stream import ExpertStream, StreamConfig, arena_budget, container_memory
from strata_stream.errors import ConfigError

GiB = 1 << 30


class Fake:
    """A fake /sys/fs/cgroup (root), /proc/self/cgroup and /proc/meminfo (100 GiB free)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, tmp: Path) -> None:
        self.root, self.proc, meminfo = tmp / "cgroup", tmp / "proc_cgroup", tmp / "meminfo"
        self.root.mkdir()
        self.proc.write_text("0::/\n")
        meminfo.write_text(f"MemTotal: {128 * GiB // 1024} kB\n"
                           f"MemAvailable: {100 * GiB // 1024} kB\n")  # fmt: skip
        monkeypatch.setattr(container_memory, "CGROUP_ROOT", str(self.root))
        monkeypatch.setattr(container_memory, "PROC_CGROUP", str(self.proc))
        monkeypatch.setattr(arena_budget, "MEMINFO", str(meminfo))

    def v2(self, path: str, limit: str, current: int = 0, inactive: int | None = None) -> None:
        d = self.root / path.strip("/")
        d.mkdir(parents=True, exist_ok=True)
        (d / "memory.max").write_text(limit + "\n")
        (d / "memory.current").write_text(f"{current}\n")
        (d / "memory.stat").unlink(missing_ok=True)
        if inactive is not None:
            (d / "memory.stat").write_text(f"anon 1\nfile 2\ninactive_file {inactive}\n")

    def v1(self, path: str, limit: int, usage: int = 0, inactive: int | None = None) -> None:
        d = self.root / "memory" / path.strip("/")
        d.mkdir(parents=True, exist_ok=True)
        (d / "memory.limit_in_bytes").write_text(f"{limit}\n")
        (d / "memory.usage_in_bytes").write_text(f"{usage}\n")
        (d / "memory.stat").unlink(missing_ok=True)
        if inactive is not None:
            (d / "memory.stat").write_text(f"cache 1\ntotal_inactive_file {inactive}\n")


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Fake:
    return Fake(monkeypatch, tmp_path)


def test_no_cgroup_files_means_no_container_limit(fake: Fake) -> None:
    assert container_memory.limit() is None and container_memory.available() is None
    assert arena_budget.available_memory() == 100 * GiB


def test_v2_limit_less_use_not_counting_inactive_page_cache(fake: Fake) -> None:
    fake.v2("/", str(8 * GiB), current=3 * GiB, inactive=GiB)  # a namespaced container: "0::/"
    assert container_memory.limit() == 8 * GiB
    # 3 GiB charged, 1 GiB of it page cache the kernel drops first: 6 GiB left.
    assert container_memory.available() == arena_budget.available_memory() == 6 * GiB
    fake.v2("/", str(8 * GiB), current=3 * GiB)  # no memory.stat: all of usage counts
    assert container_memory.available() == 5 * GiB
    fake.v2("/", str(8 * GiB), current=9 * GiB)  # over its limit: nothing left, not < 0
    assert container_memory.available() == 0
    fake.v2("/", "max")
    assert container_memory.limit() is None and container_memory.available() is None


def test_the_tightest_cgroup_on_the_process_path_binds(fake: Fake) -> None:
    """Without a namespace the process's cgroup is a path below the root, and any ancestor's
    limit applies too: the least left of them."""
    fake.proc.write_text("0::/system.slice/app.service\n")
    fake.v2("/", "max")  # the root: no limit
    fake.v2("/system.slice", str(16 * GiB), current=14 * GiB)  # 2 GiB left
    fake.v2("/system.slice/app.service", str(8 * GiB), current=GiB)  # 7 GiB left
    assert container_memory.limit() == 8 * GiB
    assert container_memory.available() == 2 * GiB
    fake.v2("/system.slice", "max")
    assert container_memory.available() == 7 * GiB


def test_a_path_this_mount_does_not_show_falls_back_to_its_root(fake: Fake) -> None:
    """A container without its own cgroup namespace may name a host path its /sys/fs/cgroup
    does not have: its own cgroup is then the mount's root."""
    fake.proc.write_text("0::/docker/0123abcd\n")
    fake.v2("/", str(4 * GiB), current=GiB)
    assert container_memory.available() == 3 * GiB


def test_v1_memory_controller_line_and_v1s_no_limit(fake: Fake) -> None:
    # A hybrid host (as the 2-core test machine): the unified hierarchy has no memory files.
    fake.proc.write_text("9:name=systemd:/\n4:memory:/process_api/abc\n1:cpu,cpuacct:/\n0::/\n")
    fake.v1("/", (1 << 63) - 4096)  # v1's "no limit" at the root
    fake.v1("/process_api/abc", 4 * GiB, usage=2 * GiB, inactive=GiB // 2)
    assert container_memory.limit() == 4 * GiB
    assert container_memory.available() == 4 * GiB - (2 * GiB - GiB // 2)
    fake.v1("/process_api/abc", (1 << 63) - 4096)
    assert container_memory.limit() is None and container_memory.available() is None


def test_v2_is_read_first_and_v1_not_at_all_where_v2_has_files(fake: Fake) -> None:
    fake.proc.write_text("4:memory:/\n0::/\n")
    fake.v2("/", "max")
    fake.v1("/", GiB)
    assert container_memory.limit() is None


def test_the_machine_wins_where_it_has_less_free_than_the_container(fake: Fake) -> None:
    fake.v2("/", str(500 * GiB))
    assert arena_budget.available_memory() == 100 * GiB


def test_an_arena_sized_from_free_memory_fits_the_container(fake: Fake) -> None:
    """arena_size with no explicit size reads available_memory(): with a 1 GiB container half
    used on a machine with 100 GiB free, the ConfigError names the container's figure."""
    fake.v2("/", str(GiB), current=GiB // 2)

    class Geometry:
        top_k, n_records = 8, 1000

    class Pack:
        geometry, record_stride = Geometry(), 64 << 20  # the minimum, 16 records: 1 GiB

    with pytest.raises(ConfigError, match=r"only 512 MiB is available"):
        arena_budget.arena_size(Pack(), None)  # type: ignore[arg-type]


class _Geometry:
    top_k, n_records = 2, 1000


class _Pack:
    geometry, record_stride = _Geometry(), 16 << 20  # every expert resident: 15.6 GiB


def test_an_explicit_arena_beyond_what_the_container_has_left_names_both(fake: Fake) -> None:
    """An explicit arena is refused before anything is mapped where the container could not
    hold it (its processes are killed at the limit, with no message): 3 GiB limit, 1 GiB used,
    4 GiB asked."""
    fake.v2("/", str(3 * GiB), current=GiB)
    with pytest.raises(ConfigError) as err:
        arena_budget.arena_size(_Pack(), 4 * GiB)  # type: ignore[arg-type]
    msg = str(err.value)
    assert str(4 * GiB) in msg and str(2 * GiB) in msg and "3.00 GiB" in msg
    # What fits is granted as asked; with no limit anywhere nothing is checked.
    assert arena_budget.arena_size(_Pack(), GiB) == GiB  # type: ignore[arg-type]
    fake.v2("/", "max")
    assert arena_budget.arena_size(_Pack(), 8 * GiB) == 8 * GiB  # type: ignore[arg-type]


def test_a_stream_with_an_arena_beyond_the_container_is_refused(
    fake: Fake, make_pack: PackFactory
) -> None:
    """ExpertStream checks too (its arena is at most the pack's bytes), before mapping."""
    path = make_pack()
    size = path.stat().st_size
    cfg = StreamConfig(arena_bytes=8 * GiB, io_threads=1, direct_io=False, persist_profile=False)
    fake.v2("/", str(size // 2), current=0)
    with pytest.raises(ConfigError, match=rf"\({size} bytes\).*\({size // 2} bytes\)"):
        ExpertStream(path, cfg)
    fake.v2("/", str(size + (64 << 20)), current=0)
    with ExpertStream(path, cfg) as s:
        assert s.n_slots > 0


def test_the_minimum_arena_message_reads_in_a_unit_that_shows_it() -> None:
    """A small pack's minimum is KiB: the message never rounds it to "0.00 GiB"."""

    class Small:
        geometry, record_stride = _Geometry(), 36 << 10  # 4 records: 144 KiB

    with pytest.raises(ConfigError) as err:
        arena_budget.arena_size(Small(), 1000)  # type: ignore[arg-type]
    assert "144 KiB" in str(err.value) and "0.00" not in str(err.value)


def test_this_machine_reads_without_error() -> None:
    """The real files, whatever they say: a limit is positive, what is left within it."""
    cap, left = container_memory.limit(), container_memory.available()
    assert cap is None or cap > 0
    assert (cap is None) == (left is None)
    assert left is None or cap is None or 0 <= left <= cap
    assert arena_budget.available_memory() > 0


def test_a_real_v1_memory_cgroup_refuses_an_explicit_arena_beyond_it(tmp_path: Path) -> None:
    """The real files: a child memory cgroup (v1, as root) with a 512 MiB limit; a process in it
    asking for a 4 GiB arena gets the ConfigError, before anything is mapped."""
    import os
    import subprocess
    import sys
    import uuid

    v1 = container_memory.VERSIONS[1]
    own = Path(container_memory.CGROUP_ROOT, v1.mount, container_memory._cgroup_path(v1).strip("/"))
    if os.geteuid() != 0 or not (own / v1.limit).exists():
        pytest.skip("needs root and the cgroup v1 memory controller")
    child = own / f"strata-test-{uuid.uuid4().hex[:12]}"
    try:
        child.mkdir()
        (child / v1.limit).write_text(f"{512 << 20}\n")
    except OSError as e:
        if child.exists():
            child.rmdir()
        pytest.skip(f"cannot make a memory cgroup here: {e}")
    script = f"""
import os, sys
with open({str(child / "cgroup.procs")!r}, "w") as f:
    f.write(str(os.getpid()))
from strata_stream import arena_budget
from strata_stream.errors import ConfigError
class G:
    top_k, n_records = 2, 1000
class P:
    geometry, record_stride = G(), 16 << 20
try:
    arena_budget.arena_size(P(), 4 << 30)
except ConfigError as e:
    print(e)
    sys.exit(0)
sys.exit(1)
"""
    try:
        got = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             timeout=120)  # fmt: skip
    finally:
        child.rmdir()  # empty again: its one process has exited
    assert got.returncode == 0, got.stdout + got.stderr
    assert f"({4 << 30} bytes) does not fit" in got.stdout and "of its 512 MiB limit" in got.stdout
