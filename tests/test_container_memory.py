"""An arena sized from free memory stays inside a container's memory limit (cgroup v2 and v1),
whatever the machine has free: a container's processes are killed at their limit."""

from __future__ import annotations

from pathlib import Path

import pytest

from strata_stream import arena_budget, container_memory

GiB = 1 << 30


@pytest.fixture
def cgroup(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Path]:
    """Fake cgroup v2 and v1 files (none written yet) and a /proc/meminfo of 100 GiB free."""
    paths = {name: tmp_path / name for name in (
        "memory.max", "memory.current", "v2.stat",
        "memory.limit_in_bytes", "memory.usage_in_bytes", "v1.stat", "meminfo")}  # fmt: skip
    monkeypatch.setattr(container_memory, "CGROUPS", (
        container_memory.CgroupFiles(str(paths["memory.max"]), str(paths["memory.current"]),
                                     str(paths["v2.stat"]), "inactive_file"),
        container_memory.CgroupFiles(str(paths["memory.limit_in_bytes"]),
                                     str(paths["memory.usage_in_bytes"]), str(paths["v1.stat"]),
                                     "total_inactive_file"),
    ))  # fmt: skip
    paths["meminfo"].write_text(f"MemTotal: {128 * GiB // 1024} kB\n"
                                f"MemAvailable: {100 * GiB // 1024} kB\n")  # fmt: skip
    monkeypatch.setattr(arena_budget, "MEMINFO", str(paths["meminfo"]))
    return paths


def test_no_cgroup_files_means_no_container_limit(cgroup: dict[str, Path]) -> None:
    assert container_memory.limit() is None and container_memory.available() is None
    assert arena_budget.available_memory() == 100 * GiB


def test_a_v2_limit_leaves_the_limit_less_what_is_used_not_counting_inactive_cache(
    cgroup: dict[str, Path],
) -> None:
    cgroup["memory.max"].write_text(f"{8 * GiB}\n")
    cgroup["memory.current"].write_text(f"{3 * GiB}\n")
    cgroup["v2.stat"].write_text(f"anon {2 * GiB}\nfile {GiB}\ninactive_file {GiB}\n")
    assert container_memory.limit() == 8 * GiB
    # 3 GiB charged, of which 1 GiB is page cache the kernel drops first: 6 GiB left.
    assert container_memory.available() == 6 * GiB
    assert arena_budget.available_memory() == 6 * GiB
    cgroup["v2.stat"].write_text("anon 0\n")  # no inactive_file line: all of usage counts
    assert container_memory.available() == 5 * GiB
    cgroup["memory.current"].write_text(f"{9 * GiB}\n")  # over the limit: nothing, not < 0
    assert container_memory.available() == 0


def test_v2_unlimited_is_no_limit_and_v1_is_not_read(cgroup: dict[str, Path]) -> None:
    cgroup["memory.max"].write_text("max\n")
    cgroup["memory.limit_in_bytes"].write_text(f"{GiB}\n")
    assert container_memory.limit() is None and container_memory.available() is None
    assert arena_budget.available_memory() == 100 * GiB


def test_a_v1_limit_and_v1s_no_limit(cgroup: dict[str, Path]) -> None:
    cgroup["memory.limit_in_bytes"].write_text(f"{4 * GiB}\n")
    cgroup["memory.usage_in_bytes"].write_text(f"{2 * GiB}\n")
    cgroup["v1.stat"].write_text(f"cache {GiB}\ntotal_inactive_file {GiB // 2}\n")
    assert container_memory.available() == 4 * GiB - (2 * GiB - GiB // 2)
    cgroup["memory.limit_in_bytes"].write_text(f"{(1 << 63) - 4096}\n")  # v1's "unlimited"
    assert container_memory.limit() is None and container_memory.available() is None


def test_the_machine_wins_where_it_has_less_free_than_the_container(
    cgroup: dict[str, Path],
) -> None:
    cgroup["memory.max"].write_text(f"{500 * GiB}\n")
    cgroup["memory.current"].write_text("0\n")
    assert arena_budget.available_memory() == 100 * GiB


def test_an_arena_sized_from_free_memory_fits_the_container(cgroup: dict[str, Path]) -> None:
    """arena_size with no explicit size reads available_memory(): with a 4 GiB container on a
    machine with 100 GiB free, the ConfigError names the container's figure, not the
    machine's."""
    from strata_stream.errors import ConfigError

    cgroup["memory.max"].write_text(f"{GiB}\n")
    cgroup["memory.current"].write_text(f"{GiB // 2}\n")

    class Geometry:
        top_k, n_records = 8, 1000

    class Pack:
        geometry, record_stride = Geometry(), 64 << 20  # 16 records: 1 GiB, the minimum

    with pytest.raises(ConfigError, match=r"only 0\.50 GiB is available"):
        arena_budget.arena_size(Pack(), None)  # type: ignore[arg-type]
