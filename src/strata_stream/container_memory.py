"""A Linux container's memory (cgroup v2, then v1): its limit, and what it leaves free.

A cgroup's processes are killed at its limit however much the machine has free, and the page
cache they fill is charged to it, so where a limit is below the machine's memory it is what
"fits in memory" means: for the direct-IO choice (`StreamConfig.direct_io_for`, through the
limit) and for an arena sized from free memory (`arena_budget.available_memory`, through what
is left).

This process's cgroup is the path /proc/self/cgroup names (v2: the `0::` line; v1: the line of
the `memory` controller), under /sys/fs/cgroup (v1: /sys/fs/cgroup/memory). Every cgroup from
there up to the root can hold a limit, and the tightest one binds. A container with its own
cgroup namespace sees its cgroup as the root; one without may name a path its /sys/fs/cgroup
does not show, and then the root is read. Where no limit file exists (macOS, a Linux without
the memory controller) there is no container limit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

PROC_CGROUP = "/proc/self/cgroup"
CGROUP_ROOT = "/sys/fs/cgroup"


@dataclass(frozen=True)
class CgroupVersion:
    mount: str  # the hierarchy's folder under CGROUP_ROOT ("" for v2)
    controller: str  # how /proc/self/cgroup names it ("" for v2's line "0::path")
    limit: str  # bytes; "max" (v2) or about 2**63 (v1) when there is none
    usage: str  # bytes charged now, the page cache included
    stat: str  # "key value" lines
    # memory.stat's keys for the page cache: on the two file LRU lists (the kernel reclaims
    # these before it kills anything), of which mapped into a process or dirty (not free to drop)
    active_file: str
    inactive_file: str
    mapped_file: str
    dirty: str


# v2 first: the first version with a limit file anywhere on the process's path is its own.
VERSIONS = (
    CgroupVersion("", "", "memory.max", "memory.current", "memory.stat",
                  "active_file", "inactive_file", "file_mapped", "file_dirty"),
    CgroupVersion("memory", "memory", "memory.limit_in_bytes", "memory.usage_in_bytes",
                  "memory.stat", "total_active_file", "total_inactive_file",
                  "total_mapped_file", "total_dirty"),
)  # fmt: skip

_NO_LIMIT = 1 << 60  # v1 writes "no limit" as 2**63 rounded down to a page


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _cgroup_path(v: CgroupVersion) -> str:
    """This process's cgroup in v's hierarchy, as /proc/self/cgroup names it ("/" if unnamed)."""
    for line in (_read(PROC_CGROUP) or "").splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if (v.controller and v.controller in controllers.split(",")) or (
            not v.controller and hierarchy == "0" and not controllers
        ):
            return path or "/"
    return "/"


def _limits(v: CgroupVersion) -> list[tuple[str, str]]:
    """(folder, limit file's text) of this process's cgroup and each ancestor whose limit file
    exists in v's hierarchy, innermost first (the hierarchy's root included)."""
    root = os.path.join(CGROUP_ROOT, v.mount) if v.mount else CGROUP_ROOT
    parts = [p for p in _cgroup_path(v).split("/") if p]
    found = []
    for n in range(len(parts), -1, -1):
        folder = os.path.join(root, *parts[:n])
        text = _read(os.path.join(folder, v.limit))
        if text is not None:
            found.append((folder, text))
    return found


def _limit(text: str) -> int | None:
    """A limit file's bytes; None for no limit ("max", or v1's 2**63 rounded to a page)."""
    value = int(text) if text.isdigit() else 0
    return value if 0 < value < _NO_LIMIT else None


def _stat(v: CgroupVersion, folder: str) -> dict[str, int]:
    found = {}
    for line in (_read(os.path.join(folder, v.stat)) or "").splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            found[key] = int(value)
    return found


def _in_use(v: CgroupVersion, folder: str) -> int:
    """What the cgroup holds that the kernel cannot give back without killing: its charge less
    the page cache it may drop. Page cache on the file LRU lists (active or inactive: a file read
    twice, as a checkpoint's shards are while loading, is on the active list) is reclaimed
    before the limit kills anything, except pages mapped into a process (mmapped weights in
    use, shared libraries' code) and dirty ones."""
    usage = _read(os.path.join(folder, v.usage)) or ""
    used = int(usage) if usage.isdigit() else 0
    st = _stat(v, folder)
    cache = st.get(v.active_file, 0) + st.get(v.inactive_file, 0)
    pinned = st.get(v.mapped_file, 0) + st.get(v.dirty, 0)
    return max(0, used - max(0, cache - pinned))


def _left(v: CgroupVersion, folder: str, cap: int) -> int:
    return max(0, cap - _in_use(v, folder))


def _limited() -> list[tuple[CgroupVersion, str, int]]:
    """(version, folder, limit) of every limited cgroup on this process's path, in the first
    version that has limit files at all."""
    for v in VERSIONS:
        found = _limits(v)
        if found:
            return [(v, f, cap) for f, text in found if (cap := _limit(text)) is not None]
    return []


def limit() -> int | None:
    """The tightest memory limit over this process's cgroup and its ancestors, in bytes; None
    where there is none."""
    caps = [cap for _, _, cap in _limited()]
    return min(caps) if caps else None


def available() -> int | None:
    """Bytes this process's cgroups can still take: for each limited one, its limit less what
    it holds, not counting the page cache the kernel would drop (_in_use); the least of them.
    None where there is no limit."""
    left = [_left(v, f, cap) for v, f, cap in _limited()]
    return min(left) if left else None


def binding() -> tuple[int, int] | None:
    """(limit, bytes left) of the limited cgroup on this process's path with the least left:
    the one whose limit an allocation meets first. None where there is no limit."""
    found = usage()
    return None if found is None else (found.limit, found.left)


@dataclass(frozen=True)
class Usage:
    """The binding cgroup's figures, in bytes: its limit, what it holds that the kernel cannot
    reclaim (in_use: its charge less the droppable page cache), and what that leaves."""

    limit: int
    in_use: int

    @property
    def left(self) -> int:
        return max(0, self.limit - self.in_use)


def usage() -> Usage | None:
    """The limited cgroup on this process's path with the least left (binding()'s), or None
    where there is no limit."""
    found = [Usage(cap, _in_use(v, f)) for v, f, cap in _limited()]
    return min(found, key=lambda u: (u.left, u.limit)) if found else None


__all__ = [
    "CGROUP_ROOT",
    "PROC_CGROUP",
    "VERSIONS",
    "CgroupVersion",
    "Usage",
    "available",
    "binding",
    "limit",
    "usage",
]
