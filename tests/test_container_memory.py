"""An arena sized from free memory stays inside a container's memory limit (cgroup v2 and v1),
whatever the machine has free: a cgroup's processes are killed at its limit. The cgroup files
here are fakes under tmp_path, with a /proc/self/cgroup and a /proc/meminfo of their own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import PackFactory
from strata_stream import ExpertStream, StreamConfig, arena_budget, container_memory
from strata_stream.errors import ConfigError
from strata_stream.units import human_bytes

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

    def v2(
        self, path: str, limit: str, current: int = 0, inactive: int | None = None, **stat: int
    ) -> None:
        """stat: more memory.stat keys (active_file, file_mapped, file_dirty)."""
        d = self.root / path.strip("/")
        d.mkdir(parents=True, exist_ok=True)
        (d / "memory.max").write_text(limit + "\n")
        (d / "memory.current").write_text(f"{current}\n")
        (d / "memory.stat").unlink(missing_ok=True)
        if inactive is not None:
            lines = {"anon": 1, "file": 2, "inactive_file": inactive, **stat}
            (d / "memory.stat").write_text("".join(f"{k} {v}\n" for k, v in lines.items()))

    def v1(
        self, path: str, limit: int, usage: int = 0, inactive: int | None = None, **stat: int
    ) -> None:
        """stat: more memory.stat keys (total_active_file, total_mapped_file, total_dirty)."""
        d = self.root / "memory" / path.strip("/")
        d.mkdir(parents=True, exist_ok=True)
        (d / "memory.limit_in_bytes").write_text(f"{limit}\n")
        (d / "memory.usage_in_bytes").write_text(f"{usage}\n")
        (d / "memory.stat").unlink(missing_ok=True)
        if inactive is not None:
            lines = {"cache": 1, "total_inactive_file": inactive, **stat}
            (d / "memory.stat").write_text("".join(f"{k} {v}\n" for k, v in lines.items()))


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Fake:
    return Fake(monkeypatch, tmp_path)


class _Geometry:
    """The pack geometry arena_budget reads (Qwen3-30B-A3B's widths by default)."""

    def __init__(self, top_k: int = 2, n_records: int = 1000, hidden: int = 2048,
                 moe_intermediate: int = 768, n_experts: int = 128) -> None:  # fmt: skip
        self.top_k, self.n_records, self.hidden = top_k, n_records, hidden
        self.moe_intermediate, self.n_experts = moe_intermediate, n_experts


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


def test_page_cache_the_kernel_can_drop_is_not_in_use_on_either_lru_list(fake: Fake) -> None:
    """A checkpoint's shards read twice while loading sit on the active file list: reclaimable
    all the same, so not in use. Mapped pages (mmapped weights, libraries) and dirty ones are."""
    fake.proc.write_text("4:memory:/job\n0::/\n")
    fake.v1("/job", 2 * GiB, usage=GiB + GiB // 2, inactive=GiB // 8,
            total_active_file=GiB // 2, total_mapped_file=GiB // 8)  # fmt: skip
    # 1.5 GiB charged; of the 0.625 GiB page cache, 0.125 GiB is mapped: 1.0 GiB in use.
    assert container_memory.usage() == container_memory.Usage(2 * GiB, GiB)
    assert container_memory.available() == GiB
    fake.v2("/", str(2 * GiB), current=GiB + GiB // 2, inactive=GiB // 8,
            active_file=GiB // 2, file_mapped=GiB // 16, file_dirty=GiB // 16)  # fmt: skip
    assert container_memory.usage() == container_memory.Usage(2 * GiB, GiB)
    assert container_memory.binding() == (2 * GiB, GiB)


class _QwenPack:
    """A ~4 GB 4-bit pack of 12 layers of Qwen3-30B-A3B's shapes (128 experts, top 8)."""

    geometry, record_stride = _Geometry(top_k=8, n_records=12 * 128), 2736128


def test_a_2gib_container_sizes_the_arena_from_what_its_limit_leaves(fake: Fake) -> None:
    """The rule: limit - in use (dense weights among it) - scratch - KV share - margin. A
    2 GiB cgroup holding 1.2 GiB (the dense weights, the runtime) and 0.6 GiB of page cache
    left from reading the checkpoint: the arena gets what is left, where the old rule (1 GiB +
    a tenth of headroom, active page cache counted as used) refused."""
    fake.proc.write_text("4:memory:/job\n0::/\n")
    in_use, cache = 1229 << 20, 614 << 20
    fake.v1("/job", 2 * GiB, usage=in_use + cache, inactive=cache // 2,
            total_active_file=cache - cache // 2)  # fmt: skip
    b = arena_budget.budget(_QwenPack(), None)  # type: ignore[arg-type]
    assert (b.source, b.memory, b.in_use, b.dense) == ("container", 2 * GiB, in_use, None)
    assert b.scratch == arena_budget.scratch_bytes(_QwenPack())  # type: ignore[arg-type]
    left = 2 * GiB - in_use  # the KV share and the margin are shares of what is left
    assert b.kv == int(0.1 * left) and b.margin == max(64 << 20, int(0.05 * left))
    assert b.arena == left - b.scratch - b.kv - b.margin > 0
    assert arena_budget.arena_size(_QwenPack(), None) == b.arena  # type: ignore[arg-type]
    # The dense weights are counted once: inside in_use when resident...
    assert arena_budget.budget(_QwenPack(), None, dense_bytes=GiB) == (  # type: ignore[arg-type]
        arena_budget.ArenaBudget(
            b.arena, "container", 2 * GiB, in_use, GiB, b.scratch, b.kv, b.margin
        )  # fmt: skip
    )
    # ...and by the front-end's figure where the container does not hold them yet (lazy).
    lazy = arena_budget.budget(_QwenPack(), None, dense_bytes=in_use + GiB // 8)  # type: ignore[arg-type]
    lazy_left = left - GiB // 8
    lazy_kv, lazy_margin = int(0.1 * lazy_left), max(64 << 20, int(0.05 * lazy_left))
    assert lazy.in_use == in_use + GiB // 8 and (lazy.kv, lazy.margin) == (lazy_kv, lazy_margin)
    assert lazy.arena == lazy_left - b.scratch - lazy_kv - lazy_margin
    # What the machine has free binds where it is less than the container leaves.
    (fake.root.parent / "meminfo").write_text(f"MemAvailable: {GiB // 2 // 1024} kB\n")
    small = arena_budget.budget(_QwenPack(), None)  # type: ignore[arg-type]
    assert (small.source, small.memory, small.in_use) == ("memory", GiB // 2, 0)


def test_too_small_a_container_names_the_limit_what_is_in_use_and_the_headroom(
    fake: Fake,
) -> None:
    fake.proc.write_text("4:memory:/job\n0::/\n")
    fake.v1("/job", 2 * GiB, usage=1843 << 20, inactive=0)
    with pytest.raises(ConfigError) as err:
        arena_budget.arena_size(_QwenPack(), None)  # type: ignore[arg-type]
    msg = str(err.value)
    kv = human_bytes(int(0.1 * ((2048 - 1843) << 20)))  # a tenth of what is left
    assert "2.00 GiB limit, 1.80 GiB is in use" in msg and f"{kv} KV cache" in msg, msg


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

    class Pack:
        geometry, record_stride = _Geometry(top_k=8), 64 << 20  # the minimum, 16 records: 1 GiB

    with pytest.raises(ConfigError, match=r"1.00 GiB limit, 512 MiB is in use .* 512 MiB is left"):
        arena_budget.arena_size(Pack(), None)  # type: ignore[arg-type]


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
        geometry, record_stride = (
            _Geometry(hidden=8, moe_intermediate=8, n_experts=4),
            36 << 10,
        )  # 4 records: 144 KiB

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
    child = _v1_child_cgroup(512 << 20)
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


def _v1_child_cgroup(limit: int) -> Path:
    """A fresh child of this process's v1 memory cgroup with `limit` bytes (skips where it
    cannot be made: not root, no v1 memory controller)."""
    import uuid

    v1 = container_memory.VERSIONS[1]
    own = Path(container_memory.CGROUP_ROOT, v1.mount, container_memory._cgroup_path(v1).strip("/"))
    if os.geteuid() != 0 or not (own / v1.limit).exists():
        pytest.skip("needs root and the cgroup v1 memory controller")
    child = own / f"strata-test-{uuid.uuid4().hex[:12]}"
    try:
        child.mkdir()
        (child / v1.limit).write_text(f"{limit}\n")
    except OSError as e:
        if child.exists():
            child.rmdir()
        pytest.skip(f"cannot make a memory cgroup here: {e}")
    return child


def test_a_model_runs_in_a_small_v1_memory_cgroup_without_an_arena_size(tmp_path: Path) -> None:
    """The real files: a transformers checkpoint loads with no arena_bytes in a 768 MiB
    memory cgroup (v1, as root), which torch and transformers alone fill by a third, and
    generates; the arena is sized from the container's limit. The rule is the one a 2 GiB
    container gets (the test's checkpoint is tiny, so its limit is scaled down): the old one
    left 1 GiB of headroom whatever the limit and refused."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from strata_stream.transformers.random_model import make_checkpoint

    ckpt = make_checkpoint("qwen3_moe", tmp_path / "model")
    limit = 768 << 20
    child = _v1_child_cgroup(limit)
    script = f"""
import json, os, sys
with open({str(child / "cgroup.procs")!r}, "w") as f:
    f.write(str(os.getpid()))
import torch
from strata_stream import arena_budget
from strata_stream.pack.reader import ExpertPack
from strata_stream.transformers import describe, load
model = load({str(ckpt)!r}, progress=False)
out = model.generate(torch.tensor([[1, 2, 3, 4]]), max_new_tokens=4, do_sample=False)
with ExpertPack.open(model.strata_pack_path) as pack:
    b = arena_budget.budget(pack, None)
print(json.dumps({{"arena": describe(model)["arena_bytes"], "tokens": out.shape[1],
                  "source": b.source, "memory": b.memory}}))
"""
    env = {**os.environ, "STRATA_CACHE": str(tmp_path / "cache")}
    try:
        got = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             timeout=300, env=env)  # fmt: skip
        oom = (child / "memory.oom_control").read_text()
    finally:
        child.rmdir()  # empty again: its one process has exited
    assert got.returncode == 0, got.stdout + got.stderr[-3000:]
    assert "oom_kill 0" in oom or "oom_kill" not in oom, oom
    row = json.loads(got.stdout.strip().splitlines()[-1])
    assert row["tokens"] == 8 and row["arena"] > 0
    assert (row["source"], row["memory"]) == ("container", limit)
