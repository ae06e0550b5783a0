"""What Linux says a process holds in memory, read so that no other process's peak is counted.

``getrusage(RUSAGE_SELF).ru_maxrss`` is the wrong peak for a measured child: Linux carries the
high-water mark of the memory image a process replaces across ``exec`` (and ``fork`` copies the
parent's), so a child started by a parent that had just built a model reports the parent's
peak. ``VmHWM`` in ``/proc/<pid>/status`` belongs to the current memory image alone, which a
fresh ``exec`` starts from nothing. Everything here is Linux only and returns None (or 0)
elsewhere.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

_PAGE = mmap.PAGESIZE
_FIELDS = {"VmHWM": "peak", "VmRSS": "resident", "RssAnon": "anonymous",
           "RssFile": "file_backed", "RssShmem": "shared"}  # fmt: skip


@dataclass(frozen=True)
class MemoryStatus:
    """One reading of /proc/<pid>/status, in bytes."""

    peak: int  # VmHWM: the most this memory image has held resident
    resident: int  # VmRSS = anonymous + file_backed + shared
    anonymous: int  # RssAnon: heap, stacks, anonymous mappings (the arena)
    file_backed: int  # RssFile: pages of mapped files (shared libraries, mmapped weights)
    shared: int  # RssShmem


def memory_status(pid: int | str = "self") -> MemoryStatus | None:
    """The process's memory now, or None where /proc has no such entry (not Linux, or the
    process has exited)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    found: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in _FIELDS:
            found[_FIELDS[key]] = int(value.split()[0]) * 1024  # kB
    if len(found) != len(_FIELDS):  # a zombie has no memory lines left
        return None
    return MemoryStatus(**found)


def peak_bytes() -> int:
    """This process's peak resident memory: VmHWM on Linux; elsewhere getrusage's ru_maxrss
    (bytes on macOS, KiB on other systems), which may include the peak of the process that
    started this one where the system carries it over, as Linux does."""
    status = memory_status()
    if status is not None:
        return status.peak
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


class PeakSampler:
    """Reads another process's /proc/<pid>/status every `interval` seconds on a thread, for
    how its peak splits into anonymous and file-backed memory (VmHWM says how much, not what).

        with PeakSampler(proc.pid) as s:
            proc.wait()
        s.at_peak  # the reading with the largest VmRSS, or None
    """

    def __init__(self, pid: int, interval: float = 0.01) -> None:
        self.pid = pid
        self.interval = interval
        self.at_peak: MemoryStatus | None = None
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            s = memory_status(self.pid)
            if s is not None:
                self.samples += 1
                if self.at_peak is None or s.resident > self.at_peak.resident:
                    self.at_peak = s
            self._stop.wait(self.interval)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()


def resident_bytes(address: int, length: int) -> int:
    """How many bytes of [address, address + length) are resident in this process (mincore),
    counted in whole pages; 0 where mincore is unavailable."""
    start = address // _PAGE * _PAGE
    pages = (address + length - start + _PAGE - 1) // _PAGE
    if pages <= 0:
        return 0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        vec = (ctypes.c_ubyte * pages)()
        rc = libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * _PAGE), vec)
    except (OSError, AttributeError):
        return 0
    if rc != 0:
        return 0
    return sum(b & 1 for b in bytes(vec)) * _PAGE


def mapped_file_bytes(suffixes: tuple[str, ...], pid: int | str = "self") -> int:
    """Resident bytes of the process's mappings of files whose names end in one of `suffixes`
    (/proc/<pid>/smaps): how much of, say, the weights is file-backed rather than copied."""
    try:
        lines = Path(f"/proc/{pid}/smaps").read_text().splitlines()
    except OSError:
        return 0
    total, counting = 0, False
    for line in lines:
        head = line.split(maxsplit=5)
        if not head:
            continue
        if not head[0].endswith(":"):  # a mapping's first line: range perms offset dev inode [path]
            counting = len(head) == 6 and head[5].endswith(suffixes)
        elif counting and head[0] == "Rss:":
            total += int(head[1]) * 1024
    return total


__all__ = [
    "MemoryStatus",
    "PeakSampler",
    "mapped_file_bytes",
    "memory_status",
    "peak_bytes",
    "resident_bytes",
]
