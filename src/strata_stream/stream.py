"""ExpertStream: the Python face of the C++ residency engine (docs/architecture.md section 4).

The engine owns the arena, the IO threads and the slot map, and checks the expert ids of every
call against the pack itself (once, in C++); the extension maps its errors onto
strata_stream.errors (csrc/python/errors.cpp). Every blocking call releases the GIL and can be
interrupted with Ctrl-C. Every method may be called from any thread; closing the stream closes
the Windows on it first (each waits for its layer in flight).

`ReadClass`, `SlotState` and `ABSENT` are the extension's own (csrc/engine/residency/slot.h),
imported from it on first use. The handshake's steps (request, wait, publish, the protections,
plans and limbo) are the Window's: called beside a running Window they would corrupt its state,
so they are test hooks, in strata_stream.testing with manual IO, faults, eviction by hand and the
invariant scan. A stream whose reads are simulated (a routing replay's) is opened by
`simulated`, not by the public constructor.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import weakref
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

from strata_stream import arena_budget
from strata_stream.config import StreamConfig
from strata_stream.errors import ForkedError, StreamClosedError

if TYPE_CHECKING:
    from strata_stream import _core
    from strata_stream._core import ABSENT, ReadClass, SlotState

# The compiled extension is imported where it is used (`from strata_stream import _core` inside
# the methods), so that the pure-Python parts (the pack writer) import even where it failed to
# build; what needs it (reading a pack's header, checksums) says so in one line.


def __getattr__(name: str) -> Any:
    # ReadClass, SlotState and ABSENT come from the extension, not from a copy here.
    if name in ("ABSENT", "ReadClass", "SlotState"):
        from strata_stream import _core

        return getattr(_core, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Closeable(Protocol):
    def close(self) -> None: ...


# ---- fork() ------------------------------------------------------------------------------------
# The engine's IO threads (and a Window's device thread) do not survive fork(), and a lock one of
# them held at the fork stays held in the child: any call there on an inherited native object may
# wait forever, and destroying one joins threads that do not exist. So in a forked child every
# wrapper opened before the fork lets go of its native object (kept alive, never destroyed: the
# parent still owns the resources) and refuses each call with ForkedError.


class ProcessBound:
    """The native object of an ExpertStream or Window, usable only in the process that made it."""

    _native: Any = None
    _opened_pid: int = 0

    def _bind(self, native: Any) -> None:
        self._native = native
        self._opened_pid = os.getpid()
        with _live_lock:
            _live.add(self)

    def _bound(self) -> Any:
        native = self._native
        if native is None:
            raise ForkedError(
                f"this {type(self).__name__} was opened in another process (pid "
                f"{self._opened_pid}; this is {os.getpid()}, made by fork()); open the pack again "
                f"in this one"
            )
        return native

    @property
    def _inherited(self) -> bool:
        """Whether this object was opened before a fork() made this process (unusable here)."""
        return self._native is None and self._opened_pid != 0

    def _disown(self) -> None:
        native, self._native = self._native, None
        if native is not None:
            _leak(native)


_live: weakref.WeakSet[ProcessBound] = weakref.WeakSet()
_live_lock = threading.Lock()
_leaked: list[Any] = []


def _leak(native: Any) -> None:
    # A strong reference from this module's list is dropped at interpreter exit, which would run
    # the destructor then; one more reference count keeps it for good.
    _leaked.append(native)
    if sys.implementation.name == "cpython":
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(native))


def _after_fork_in_child() -> None:
    global _live_lock
    _live_lock = threading.Lock()  # the parent may have held it at the fork
    for obj in list(_live):
        obj._disown()
    _live.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class ExpertStream(ProcessBound):
    """Streams a pack's experts into a bounded arena.

    `ExpertStream(pack_or_path, config)`; use as a context manager or call close(). Usable in
    the process that opened it: after fork() a child's calls raise ForkedError (its close() does
    nothing), and the child opens the pack again.
    """

    def __init__(self, pack: str | os.PathLike[str] | Any, config: StreamConfig | None = None):
        self._open(pack, config, simulate_io=False)

    def _open(
        self, pack: str | os.PathLike[str] | Any, config: StreamConfig | None, *, simulate_io: bool
    ) -> None:
        from strata_stream import _core

        self.config = config if config is not None else StreamConfig.from_env()
        path = getattr(pack, "path", pack)
        self.path = Path(path)
        c = self.config
        self._auto_buffered = ""  # direct_note's reason where auto chose buffered reads
        try:
            size = self.path.stat().st_size
        except OSError:
            size = 0  # the stream's own open names the missing file
        # The engine's arena holds at most every record, so never more than the pack's bytes.
        if size:
            arena_budget.check_fits(min(c.arena_bytes, size))
        direct = c.direct_io
        if direct is None:
            direct = c.direct_io_for(size)
            if not direct:
                self._auto_buffered = (
                    f"buffered reads (direct_io auto: the {size / 1e9:.2f} GB pack fits a quarter "
                    f"of the memory)"
                )
        native = _core.Stream(str(self.path), c.stream_options(direct, simulate_io))
        self._bind(native)
        # The Python Windows on this stream, closed (trace and profile written) before it.
        self._windows: weakref.WeakSet[_Closeable] = weakref.WeakSet()
        self._windows_lock = threading.Lock()
        layout = self._s.layout
        self.n_layers: int = int(layout["n_layers"])
        self.n_experts: int = int(layout["n_experts"])
        self.top_k: int = int(layout["top_k"])
        self.record_stride: int = int(layout["record_stride"])

    @property
    def _s(self) -> _core.Stream:
        """The native stream; ForkedError in a process forked after it was opened."""
        native: _core.Stream = self._bound()
        return native

    # ---- lifecycle -------------------------------------------------------------------------
    def close(self) -> None:
        """Closes the Windows on this stream (each waits for its layer in flight, then fails its
        turn with StreamClosedError), then stops the IO threads. A read stuck in the kernel for
        longer than io_timeout_s is left to finish on its own, with a RuntimeWarning naming it:
        the arena stays allocated until it returns. Idempotent and safe from any thread. In a
        process forked after the stream opened it does nothing (the parent owns the stream)."""
        if self._inherited:
            return
        with self._windows_lock:
            windows = list(self._windows)
        for window in windows:
            window.close()
        self._s.close()  # also closes Windows made on the extension directly

    def _attach(self, window: _Closeable) -> None:
        with self._windows_lock:
            self._windows.add(window)

    @property
    def closed(self) -> bool:
        return self._s.closed

    def __enter__(self) -> ExpertStream:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ---- geometry ----------------------------------------------------------------------------
    @property
    def n_slots(self) -> int:
        return self._s.n_slots

    @property
    def direct_io(self) -> bool:
        """Whether reads really bypass the page cache (O_DIRECT / F_NOCACHE)."""
        return self._s.direct_io

    @property
    def direct_note(self) -> str:
        """How the pack is read, and why where it is not read directly."""
        return self._auto_buffered or self._s.direct_note

    # ---- views -------------------------------------------------------------------------------
    def slot_table(self) -> dict[str, npt.NDArray[Any]]:
        return dict(self._s.slots())

    def arena_view(self) -> npt.NDArray[np.uint8]:
        """Read-only view of the whole arena, [n_slots, slot_stride] bytes (no copy); slot s
        holds its record at row s. Valid while the stream is open; contents change as slots are
        recycled, so read a slot only while the handshake guarantees it
        (Window.moe_routed_external).
        """
        return self._s.arena.reshape(self.n_slots, self._s.slot_bytes_stride)

    def expert_bytes(self, layer: int, expert: int) -> npt.NDArray[np.uint8] | None:
        """The record bytes of a published expert (a read-only view), or None when it is not
        published. IndexError for a layer or expert out of range."""
        view: npt.NDArray[np.uint8] | None = self._s.expert_bytes(layer, expert)
        return view

    def fill(self) -> bool:
        """Reads every expert of the pack now when the arena has a slot for each (as plain
        loading reads every weight: nothing is then left to stream or ever evicted); returns
        whether it did. Interruptible with Ctrl-C; a failed read raises ExpertReadError."""
        return self._s.fill()

    def stats(self) -> dict[str, Any]:
        """The stream's counters since it opened: hits and misses of urgent requests,
        speculative reads (requested, hits, dropped, failed), bytes and records read, where the
        IO threads' time went (read_seconds, crc_seconds, observer_seconds, io_job_seconds,
        io_job_cpu_seconds), stall_seconds (the host blocked in wait()), and the miss phases:
        for the miss_timed reads that were urgent from their start, the seconds from queueing
        to their first part (miss_queued_seconds), of reads (miss_read_seconds), of the CRC and
        the record observers such as a backend's device copies (miss_finish_seconds) and to
        publication (miss_publish_seconds), summed. Also n_slots and direct_io."""
        out: dict[str, Any] = dict(self._s.stats())
        out["n_slots"] = self.n_slots
        out["direct_io"] = self.direct_io
        return out

    def __repr__(self) -> str:
        if self._inherited:
            return f"ExpertStream({str(self.path)!r}, opened in process {self._opened_pid})"
        state = "closed" if self.closed else f"{self.n_slots} slots"
        return f"ExpertStream({str(self.path)!r}, {state})"


def simulated(pack: str | os.PathLike[str] | Any, config: StreamConfig) -> ExpertStream:
    """An ExpertStream whose part reads complete without touching the file (a routing replay's:
    strata_stream.trace.replay). Its expert bytes are undefined: never compute with it."""
    stream = ExpertStream.__new__(ExpertStream)
    stream._open(pack, config, simulate_io=True)
    return stream


__all__ = ["ABSENT", "ExpertStream", "ReadClass", "SlotState", "StreamClosedError"]
