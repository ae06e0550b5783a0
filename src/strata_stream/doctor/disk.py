"""The pack disk's read bandwidth, read the way the engine's IO pool reads expert records.

A temporary file in the chosen folder stands in for a pack: records of one size, each on the
pack's 16 KiB boundary, read in a shuffled order (a decode step's misses are scattered over the
pack), each split into parts of at most the engine's part size, `threads` threads taking the
next part from a shared counter, every part one positional read into that thread's own
page-aligned buffer. Three modes:
- direct: O_DIRECT, the engine's choice for a pack larger than a quarter of the memory;
- buffered: through the page cache, emptied of the file before each pass (posix_fadvise
  DONTNEED) with read-ahead off, so it measures the disk, not memory;
- cached: from the page cache, warmed by reading the whole file first. A pack smaller than a
  quarter of the memory is read buffered and stays cached: its misses cost a copy and the IO
  threads' hand-offs, not a device read.
Python threads release the interpreter lock while they read, so the figure is the disk's, less
what Python's per-part overhead costs a fast device: a floor for the engine's C++ pool.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import queue
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from strata_stream.config import DEFAULT_IO_THREADS, StreamConfig
from strata_stream.errors import ConfigError
from strata_stream.pack.header import PAGE, align_up
from strata_stream.units import human_bytes

MODES = ("direct", "buffered", "cached")
# Expert records from one pack page (a tiny model's: latency, not bandwidth, decides) through a
# small model's, Qwen3-30B-A3B's at q4 (about 3 MiB) to a large model's (DeepSeek-V3's at q4:
# about 24 MiB).
RECORD_SIZES = (PAGE, 256 << 10, 3 << 20, 24 << 20)
FILE_BYTES = 256 << 20
PASS_SECONDS = 0.5  # a pass stops taking new parts after this long (it has read enough)
_CHUNK = 16 << 20
_READ_TIMEOUT_S = 60.0  # a lone record's read that takes longer fails the pass


def io_thread_counts() -> tuple[int, ...]:
    """One thread (a lone reader) and the engine's default IO thread count here."""
    return tuple(sorted({1, DEFAULT_IO_THREADS}))


@dataclass(frozen=True)
class DiskReading:
    mode: str  # "direct", "buffered" (page cache emptied first) or "cached" (page cache warm)
    record_bytes: int
    threads: int
    bytes_read: int
    seconds: float
    # A lone record's read, from asking the sleeping IO threads to its last part landing
    # (median): what a decode step that misses one expert waits, hand-offs included.
    latency_s: float = 0.0

    @property
    def gbps(self) -> float:
        """Decimal GB per second."""
        return self.bytes_read / self.seconds / 1e9 if self.seconds > 0 else 0.0


def parts_of(record_bytes: int, part_bytes: int) -> list[tuple[int, int]]:
    """(offset inside the record, length) of its parts: equal whole pages, at most part_bytes
    each, the last one shorter where the record does not divide."""
    n = -(-record_bytes // part_bytes)
    size = align_up(-(-record_bytes // n), PAGE)
    return [
        (o, min(size, align_up(record_bytes, PAGE) - o))
        for o in range(0, align_up(record_bytes, PAGE), size)
    ]


def _write_file(path: Path, nbytes: int) -> None:
    block = random.Random(0).randbytes(_CHUNK)  # incompressible, whatever the file system
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        written = 0
        while written < nbytes:
            written += os.write(fd, block[: min(_CHUNK, nbytes - written)])
        os.fsync(fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _open(path: Path, mode: str) -> int:
    if mode == "direct":
        flag = getattr(os, "O_DIRECT", None)
        if flag is None:
            raise OSError("O_DIRECT is not available on this system")
        return os.open(path, os.O_RDONLY | flag)
    fd = os.open(path, os.O_RDONLY)
    if mode == "cached":
        _warm(fd)
    elif hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # nothing of it cached
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead: records are scattered
    return fd


def _warm(fd: int) -> None:
    """Reads the whole file once, so the page cache holds it."""
    offset = 0
    while chunk := os.pread(fd, _CHUNK, offset):
        offset += len(chunk)


def read_pass(
    path: Path,
    mode: str,
    record_bytes: int,
    threads: int,
    file_bytes: int,
    part_bytes: int,
    seconds: float,
    seed: int = 0,
) -> DiskReading:
    """One measurement: every record of the file in a shuffled order (or as many as `seconds`
    allows), its parts read by `threads` threads."""
    stride = align_up(record_bytes, PAGE)
    records = list(range(file_bytes // stride))
    if not records:
        raise ConfigError(f"a {file_bytes}-byte file holds no record of {record_bytes} bytes")
    random.Random(seed).shuffle(records)
    parts = [(r * stride + o, n) for r in records for o, n in parts_of(record_bytes, part_bytes)]
    largest = max(n for _, n in parts)
    fd = _open(path, mode)
    lock = threading.Lock()
    state = {"next": 0, "bytes": 0}
    errors: list[BaseException] = []
    deadline = [0.0]

    def reader() -> None:
        buf = mmap.mmap(-1, largest)  # page-aligned, as O_DIRECT needs
        view = memoryview(buf)
        got = 0
        try:
            while True:
                with lock:
                    i = state["next"]
                    if i >= len(parts) or time.perf_counter() > deadline[0]:
                        break
                    state["next"] = i + 1
                offset, n = parts[i]
                done = os.preadv(fd, [view[:n]], offset)
                if done != n:
                    raise OSError(f"short read: {done} of {n} bytes at offset {offset}")
                got += n
        except BaseException as e:  # noqa: BLE001 - handed to the measuring thread
            errors.append(e)
        finally:
            with lock:
                state["bytes"] += got
            view.release()
            buf.close()

    pool = [threading.Thread(target=reader, daemon=True) for _ in range(threads)]
    try:
        t0 = time.perf_counter()
        deadline[0] = t0 + seconds
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        wall = time.perf_counter() - t0
    finally:
        os.close(fd)
    if errors:
        raise errors[0]
    return DiskReading(mode, record_bytes, threads, state["bytes"], wall)


def lone_latency(
    path: Path,
    mode: str,
    record_bytes: int,
    threads: int,
    file_bytes: int,
    part_bytes: int,
    seconds: float,
    seed: int = 1,
) -> float:
    """The median time one record takes, read alone by a pool of `threads` threads that sleep
    on a queue between reads (as the engine's IO threads do), from the request to its last
    part: records in a shuffled order, one at a time, for at most `seconds` or 64 records."""
    stride = align_up(record_bytes, PAGE)
    records = list(range(file_bytes // stride))
    random.Random(seed).shuffle(records)
    parts = parts_of(record_bytes, part_bytes)
    largest = max(n for _, n in parts)
    fd = _open(path, mode)
    jobs: queue.Queue[tuple[int, int, list[int], threading.Event] | None] = queue.Queue()
    errors: list[BaseException] = []
    lock = threading.Lock()

    def reader() -> None:
        buf = mmap.mmap(-1, largest)
        view = memoryview(buf)
        try:
            while (job := jobs.get()) is not None:
                offset, n, left, done = job
                try:
                    if os.preadv(fd, [view[:n]], offset) != n:
                        raise OSError(f"short read at offset {offset}")
                except BaseException as e:  # noqa: BLE001 - handed to the measuring thread
                    errors.append(e)
                with lock:
                    left[0] -= 1
                    last = left[0] == 0
                if last:
                    done.set()
        finally:
            view.release()
            buf.close()

    pool = [threading.Thread(target=reader, daemon=True) for _ in range(threads)]
    for t in pool:
        t.start()
    times: list[float] = []
    try:
        end = time.perf_counter() + seconds
        for r in records[:64]:
            done = threading.Event()
            left = [len(parts)]
            t0 = time.perf_counter()
            for o, n in parts:
                jobs.put((r * stride + o, n, left, done))
            if not done.wait(_READ_TIMEOUT_S):  # a reader that could not start: no hang
                raise OSError(f"a {human_bytes(record_bytes)} read took over {_READ_TIMEOUT_S} s")
            times.append(time.perf_counter() - t0)
            if errors:
                raise errors[0]
            if time.perf_counter() > end:
                break
    finally:
        for _ in pool:
            jobs.put(None)
        for t in pool:
            t.join()
        os.close(fd)
    return statistics.median(times)


def measure_disk(
    folder: str | os.PathLike[str],
    record_sizes: Sequence[int] | None = None,
    threads: Sequence[int] | None = None,
    modes: Sequence[str] = MODES,
    file_bytes: int | None = None,
    seconds: float | None = None,
    progress: bool = True,
) -> tuple[list[DiskReading], list[str]]:
    """Every (mode, record size, thread count) pass over a temporary file in `folder`, and
    notes on what could not be measured (direct reads where the file system refuses O_DIRECT).
    The file is removed afterwards, also on an error or Ctrl-C. Left out, the sizes, thread
    counts, file size and time a pass are this module's RECORD_SIZES, io_thread_counts(),
    FILE_BYTES and PASS_SECONDS."""
    from tqdm import tqdm

    record_sizes = RECORD_SIZES if record_sizes is None else record_sizes
    file_bytes = FILE_BYTES if file_bytes is None else file_bytes
    seconds = PASS_SECONDS if seconds is None else seconds

    where = Path(folder).expanduser()
    if not where.is_dir():
        raise ConfigError(f"--path {folder}: no such directory")
    counts = tuple(threads) if threads is not None else io_thread_counts()
    part_bytes = StreamConfig().part_bytes
    plan = [(m, s, t) for m in modes for s in record_sizes for t in counts]
    readings: list[DiskReading] = []
    notes: list[str] = []
    try:
        fd, name = tempfile.mkstemp(prefix=".strata-doctor-", dir=where)
    except OSError as e:
        raise ConfigError(f"--path {where}: cannot write a test file: {e.strerror}") from None
    os.close(fd)
    path = Path(name)
    bar = tqdm(total=len(plan) + 1, desc="doctor", unit="pass", disable=not progress, leave=False)
    try:
        bar.set_postfix_str(f"writing {file_bytes >> 20} MiB in {where}")
        try:
            _write_file(path, file_bytes)
        except OSError as e:
            raise ConfigError(f"--path {where}: cannot write a test file: {e.strerror}") from None
        bar.update()
        refused: set[str] = set()
        for mode, size, n in plan:
            bar.set_postfix_str(f"{mode} {human_bytes(size)} x {n} threads")
            if mode not in refused:
                try:
                    r = read_pass(path, mode, size, n, file_bytes, part_bytes, seconds)
                    lat = lone_latency(path, mode, size, n, file_bytes, part_bytes, seconds / 2)
                    readings.append(dataclasses.replace(r, latency_s=lat))
                except OSError as e:
                    if mode != "direct":
                        raise
                    refused.add(mode)
                    notes.append(
                        f"direct reads refused here ({e.strerror or e}): the engine "
                        "falls back to buffered reads on this file system"
                    )
            bar.update()
    finally:
        bar.close()
        path.unlink(missing_ok=True)
    return readings, notes


__all__ = [
    "FILE_BYTES",
    "MODES",
    "RECORD_SIZES",
    "DiskReading",
    "io_thread_counts",
    "lone_latency",
    "measure_disk",
    "parts_of",
    "read_pass",
]
