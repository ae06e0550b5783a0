"""The conditions a peer run happens under: a memory cgroup, a cold page cache, a disk's
read-ahead. Linux, as root (cgroup v1's memory controller or cgroup v2).

- `run_limited(cmd, limit)`: the command in a fresh memory cgroup of `limit` bytes (None: no
  limit), after dropping the page cache (so no run finds another's pages cached); returns its
  exit status, whether the kernel killed it for memory, its peak resident memory and the
  cgroup's peak (page cache charged to it included), and its wall time.
- `read_ahead(path, kb)`: the read-ahead of the disk holding `path`, set for a block of runs and
  restored after (every process reading that disk sees it meanwhile).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

V1 = Path("/sys/fs/cgroup/memory")
V2 = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class Outcome:
    returncode: int
    oom_killed: bool
    wall_s: float
    peak_rss_bytes: int  # the process's own peak resident memory (ru_maxrss)
    cgroup_peak_bytes: int | None  # the cgroup's peak charge, page cache included
    storage_read_bytes: int  # blocks read from storage for the process (ru_inblock)


def _read_ahead_file(path: Path) -> Path | None:
    dev = os.stat(path).st_dev
    sysdev = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    for queue in (sysdev / "queue", sysdev / ".." / "queue"):
        if (queue / "read_ahead_kb").exists():
            return queue / "read_ahead_kb"
    return None


def disk_read_ahead_kb(path: Path) -> int | None:
    """read_ahead_kb of the block device holding `path` (its whole disk's queue)."""
    f = _read_ahead_file(path)
    return int(f.read_text()) if f is not None else None


def drop_page_cache() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


class _Cgroup:
    """A memory cgroup of its own for one run (v1 where its memory controller is mounted)."""

    def __init__(self, limit: int | None) -> None:
        name = f"strata-peers-{os.getpid()}-{time.monotonic_ns()}"
        self.v1 = (V1 / "memory.limit_in_bytes").exists()
        self.path = (V1 if self.v1 else V2) / name
        self.path.mkdir()
        if limit is not None:
            if self.v1:
                (self.path / "memory.limit_in_bytes").write_text(str(limit))
            else:
                (self.path / "memory.max").write_text(str(limit))
                (self.path / "memory.swap.max").write_text("0")

    def enter(self) -> None:  # in the child, before exec
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak(self) -> int | None:
        f = self.path / ("memory.max_usage_in_bytes" if self.v1 else "memory.peak")
        return int(f.read_text()) if f.exists() else None

    def oom_kills(self) -> int:
        f = self.path / ("memory.oom_control" if self.v1 else "memory.events")
        for line in f.read_text().splitlines() if f.exists() else []:
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def remove(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def run_limited(
    cmd: list[str], limit: int | None, log: Path, drop_cache: bool = True, timeout_s: float = 3600
) -> Outcome:
    if drop_cache:
        drop_page_cache()
    group = _Cgroup(limit)
    try:
        t0 = time.perf_counter()
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, preexec_fn=group.enter)
            timer = threading.Timer(timeout_s, proc.kill)  # nothing hangs the comparison
            timer.start()
            try:
                _, status, usage = os.wait4(proc.pid, 0)
            except BaseException:
                proc.kill()
                raise
            finally:
                timer.cancel()
            proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - t0
        killed = proc.returncode == -signal.SIGKILL
        return Outcome(
            returncode=proc.returncode,
            oom_killed=killed and group.oom_kills() > 0,
            wall_s=wall,
            peak_rss_bytes=usage.ru_maxrss * 1024,
            cgroup_peak_bytes=group.peak(),
            storage_read_bytes=usage.ru_inblock * 512,
        )
    finally:
        group.remove()


@contextlib.contextmanager
def read_ahead(path: Path, kb: int) -> Iterator[int]:
    """The read-ahead of the disk holding `path` set to `kb` for the block, then restored:
    llama.cpp's mmap path reads through it, so a run at the usual Linux NVMe default (128 KB)
    needs no other machine. Yields the setting the kernel took."""
    f = _read_ahead_file(path)
    if f is None:
        raise RuntimeError(f"no read_ahead_kb for the disk holding {path}")
    before = f.read_text().strip()
    f.write_text(str(kb))
    try:
        yield int(f.read_text())
    finally:
        f.write_text(before)
