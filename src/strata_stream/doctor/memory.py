"""The memory a process can have here, and how fast one core reads it."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from strata_stream import arena_budget, container_memory


@dataclass(frozen=True)
class MemoryReport:
    """Bytes, as the arena rule sees them (arena_budget.available_memory)."""

    total: int | None  # the machine's physical memory
    available: int  # what the process can take without swapping or meeting its container's limit
    container_limit: int | None  # the tightest cgroup limit on this process's path; None: none
    container_left: int | None  # that limit less what the cgroup uses (page cache excepted)


def _total() -> int | None:
    try:
        pages, page = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None
    return pages * page if pages > 0 and page > 0 else None


def memory_report() -> MemoryReport:
    return MemoryReport(
        total=_total(),
        available=arena_budget.available_memory(),
        container_limit=container_memory.limit(),
        container_left=container_memory.available(),
    )


def memory_bandwidth(nbytes: int = 256 << 20, rounds: int = 3) -> float:
    """Bytes per second this process's cores read from memory together: numpy summing one
    slice of a buffer larger than the caches on each usable core (numpy releases the
    interpreter lock while it sums), the best of `rounds` passes. A decode step that finds its
    weights resident reads them at most this fast."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    n = max(1, cores or 1)
    a = np.ones(nbytes // 8 // n * n, dtype=np.float64)
    slices = np.split(a, n)
    a.sum()  # fault the pages in before timing
    best = float("inf")
    with ThreadPoolExecutor(n) as pool:
        for _ in range(rounds):
            t0 = time.perf_counter()
            list(pool.map(np.sum, slices))
            best = min(best, time.perf_counter() - t0)
    return a.nbytes / best


__all__ = ["MemoryReport", "memory_bandwidth", "memory_report"]
