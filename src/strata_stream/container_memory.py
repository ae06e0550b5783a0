"""A Linux container's memory (cgroup v2, then v1): its limit, and what it leaves free.

A container's processes are killed at its limit however much the machine has free, and the
page cache they fill is charged to it, so where a limit is below the machine's memory it is what
"fits in memory" means: for the direct-IO choice (`StreamConfig.direct_io_for`, through the
limit) and for an arena sized from free memory (`arena_budget.available_memory`, through what
is left). The files are those a container with its own cgroup namespace sees at
/sys/fs/cgroup; where they are absent (macOS, a Linux without the memory controller, the root
cgroup) there is no container limit.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CgroupFiles:
    limit: str  # the limit in bytes; "max" (v2) or about 2**63 (v1) when there is none
    usage: str  # bytes charged now, the page cache included
    stat: str  # "key value" lines
    inactive_file: str  # memory.stat's key for page cache the kernel reclaims first


# cgroup v2 first: the first version whose limit file exists is this process's.
CGROUPS = (
    CgroupFiles("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current",
                "/sys/fs/cgroup/memory.stat", "inactive_file"),
    CgroupFiles("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                "/sys/fs/cgroup/memory/memory.usage_in_bytes",
                "/sys/fs/cgroup/memory/memory.stat", "total_inactive_file"),
)  # fmt: skip

_NO_LIMIT = 1 << 60  # v1 writes "no limit" as 2**63 rounded down to a page


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _files() -> tuple[CgroupFiles, int | None] | None:
    """This process's cgroup version and its limit (None: unlimited); None without one."""
    for files in CGROUPS:
        text = _read(files.limit)
        if text is None:
            continue
        limit = int(text) if text.isdigit() else None
        return files, limit if limit is not None and 0 < limit < _NO_LIMIT else None
    return None


def limit() -> int | None:
    """The container's memory limit in bytes; None where there is none."""
    found = _files()
    return found[1] if found else None


def available() -> int | None:
    """Bytes the container can still take: its limit less what it uses, not counting the page
    cache the kernel would drop first (inactive files); None where there is no limit."""
    found = _files()
    if not found:
        return None
    files, cap = found
    if cap is None:
        return None
    usage = _read(files.usage)
    used = int(usage) if usage and usage.isdigit() else 0
    stat = _read(files.stat) or ""
    for line in stat.splitlines():
        key, _, value = line.partition(" ")
        if key == files.inactive_file and value.strip().isdigit():
            used -= int(value)
            break
    return max(0, cap - max(0, used))


__all__ = ["CGROUPS", "CgroupFiles", "available", "limit"]
