"""ExpertStream: the Python face of the C++ residency engine (docs/architecture.md section 4).

The engine owns the arena, the IO threads and the slot map; this wrapper checks arguments
and converts engine errors into strata_stream.errors (the extension does that already; see
csrc/python/module.cpp). Every blocking call releases the GIL and can be interrupted with
Ctrl-C. Every method may be called from any thread; closing the stream closes the Windows on it
first (each waits for its layer in flight).

`ReadClass`, `SlotState` and `ABSENT` are the extension's own (csrc/engine/residency/slot.h),
imported from it on first use.
"""

from __future__ import annotations

import importlib
import os
import threading
import weakref
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

from strata_stream.config import StreamConfig
from strata_stream.errors import StreamClosedError

if TYPE_CHECKING:
    from strata_stream._core import ABSENT, ReadClass, SlotState


def _core() -> Any:
    # The compiled extension, imported on first use so that the pure-Python parts (pack
    # writer, CLI inspect/verify) work even where the extension failed to build.
    return importlib.import_module("strata_stream._core")


def __getattr__(name: str) -> Any:
    # ReadClass, SlotState and ABSENT come from the extension, not from a copy here.
    if name in ("ABSENT", "ReadClass", "SlotState"):
        return getattr(_core(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Closeable(Protocol):
    def close(self) -> None: ...


def _experts(experts: int | Iterable[int] | npt.ArrayLike, what: str) -> npt.NDArray[np.int32]:
    arr = np.asarray(experts)
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if arr.ndim != 1:
        raise ValueError(f"{what}: expected a 1-D list of expert ids, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{what}: expert ids must be integers, got dtype {arr.dtype}")
    info = np.iinfo(np.int32)
    if arr.size and (int(arr.min()) < info.min or int(arr.max()) > info.max):
        # The cast below would wrap (2**32 + 3 -> 3) and pass the range check as another expert.
        bad = arr[(arr < info.min) | (arr > info.max)][0]
        raise IndexError(f"{what}: expert {bad} out of range")
    return np.ascontiguousarray(arr, dtype=np.int32)


class ExpertStream:
    """Streams a pack's experts into a bounded arena.

    `ExpertStream(pack_or_path, config)`; use as a context manager or call close().
    """

    def __init__(
        self,
        pack: str | os.PathLike[str] | Any,
        config: StreamConfig | None = None,
        *,
        simulate_io: bool = False,
    ):
        """simulate_io (replay only): reads complete without touching the file; expert bytes
        are then undefined, so never compute with such a stream."""
        self.config = config if config is not None else StreamConfig.from_env()
        path = getattr(pack, "path", pack)
        self.path = Path(path)
        c = self.config
        self._s = _core().Stream(
            str(self.path),
            arena_bytes=c.arena_bytes,
            io_threads=c.io_threads,
            part_bytes=c.part_bytes,
            direct_io=c.direct_io,
            verify_reads=c.verify_reads,
            io_timeout_s=c.io_timeout_s,
            publish_prefetch=c.publish_prefetch,
            simulate_io=simulate_io,
            eviction=c.eviction,
        )
        # The Python Windows on this stream, closed (trace and profile written) before it.
        self._windows: weakref.WeakSet[_Closeable] = weakref.WeakSet()
        self._windows_lock = threading.Lock()
        layout = self._s.layout
        self.n_layers: int = int(layout["n_layers"])
        self.n_experts: int = int(layout["n_experts"])
        self.top_k: int = int(layout["top_k"])
        self.record_stride: int = int(layout["record_stride"])
        self.record_bytes: int = int(layout["record_bytes"])

    # ---- lifecycle -------------------------------------------------------------------------
    def close(self) -> None:
        """Closes the Windows on this stream (each waits for its layer in flight, then fails its
        turn with StreamClosedError), then stops the IO threads. A read stuck in the kernel for
        longer than io_timeout_s is left to finish on its own, with a RuntimeWarning naming it:
        the arena stays allocated until it returns. Idempotent and safe from any thread."""
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
        return bool(self._s.closed)

    def __enter__(self) -> ExpertStream:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _check_layer(self, layer: int) -> int:
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
            raise TypeError(f"layer must be an int, got {type(layer).__name__}")
        if not 0 <= int(layer) < self.n_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.n_layers})")
        return int(layer)

    def _check_expert(self, expert: int) -> int:
        if isinstance(expert, bool) or not isinstance(expert, (int, np.integer)):
            raise TypeError(f"expert must be an int, got {type(expert).__name__}")
        if not 0 <= int(expert) < self.n_experts:
            raise IndexError(f"expert {expert} out of range [0, {self.n_experts})")
        return int(expert)

    def _ids(self, experts: Any, what: str) -> npt.NDArray[np.int32]:
        ids = _experts(experts, what)
        if ids.size and (ids.min() < 0 or ids.max() >= self.n_experts):
            bad = ids[(ids < 0) | (ids >= self.n_experts)][0]
            raise IndexError(f"{what}: expert {bad} out of range [0, {self.n_experts})")
        return ids

    # ---- geometry ----------------------------------------------------------------------------
    @property
    def n_slots(self) -> int:
        return int(self._s.n_slots)

    @property
    def n_parts(self) -> int:
        """Part reads per expert record."""
        return int(self._s.n_parts)

    @property
    def direct_io(self) -> bool:
        """Whether reads really bypass the page cache (O_DIRECT / F_NOCACHE)."""
        return bool(self._s.direct_io)

    @property
    def direct_note(self) -> str:
        return str(self._s.direct_note)

    def key(self, layer: int, expert: int) -> int:
        """The smap index of (layer, expert); IndexError when either is out of range."""
        return int(self._s.key(self._check_layer(layer), self._check_expert(expert)))

    # ---- requests and waits ------------------------------------------------------------------
    def request(
        self, layer: int, experts: Any, urgent: bool = True, cls: ReadClass | None = None
    ) -> tuple[int, int, int]:
        """Makes experts resident or loading. Returns (hits, misses, dropped).

        Urgent requests evict as needed; speculative ones (urgent=False, cls PRED1 by default)
        take only free or evictable slots and stop when none is left.
        """
        classes = _core().ReadClass
        read_class = cls if cls is not None else (classes.URGENT if urgent else classes.PRED1)
        if urgent and cls is not None and cls != classes.URGENT:
            raise ValueError("urgent=True contradicts a speculative cls")
        ids = self._ids(experts, "request")
        h, m, d = self._s.request(self._check_layer(layer), ids, classes(int(read_class)))
        return int(h), int(m), int(d)

    def wait(self, layer: int, experts: Any) -> None:
        """Blocks until the experts are complete and published (requesting any not requested)."""
        self._s.wait(self._check_layer(layer), self._ids(experts, "wait"))

    def publish(self, layer: int) -> int:
        """Handshake publication for layers layer+1..layer+2; returns how many were published."""
        return int(self._s.publish(self._check_layer(layer)))

    # ---- protections -------------------------------------------------------------------------
    def enter_layer(self, layer: int, experts: Any = None) -> None:
        """Marks `layer` executing: its slots (or only `experts`, when given) are protected."""
        ids = None if experts is None else self._ids(experts, "enter_layer")
        self._s.enter_layer(self._check_layer(layer), ids)

    def after_layer(self, layer: int) -> None:
        self._s.after_layer(self._check_layer(layer))

    def end_turn(self) -> None:
        self._s.end_turn()

    def plan(self, layer: int, experts: Any) -> npt.NDArray[np.bool_]:
        """Which experts are resident now; pins them until release_plan() (I8)."""
        mask = self._s.plan(self._check_layer(layer), self._ids(experts, "plan"))
        return np.asarray(mask, dtype=bool)

    def release_plan(self) -> None:
        self._s.release_plan()

    # ---- lifecycle primitives ----------------------------------------------------------------
    def cancel(self, layer: int, expert: int) -> bool:
        """Cancels a queued read (no part begun). False when it is not cancellable."""
        return bool(self._s.cancel(self._check_layer(layer), int(expert)))

    def retire_unused_pre(self, layer: int, chosen: Any) -> int:
        """Parks this layer's unchosen speculative slots in limbo; returns how many."""
        return int(self._s.retire_unused_pre(self._check_layer(layer), self._ids(chosen, "chosen")))

    def release_limbo(self) -> int:
        return int(self._s.release_limbo())

    def victim(self, speculative: bool = False) -> int | None:
        v = int(self._s.victim(speculative))
        return None if v < 0 else v

    def evict(self) -> int | None:
        v = int(self._s.evict_one())
        return None if v < 0 else v

    # ---- views -------------------------------------------------------------------------------
    @property
    def smap(self) -> npt.NDArray[np.uint32]:
        """Read-only view of the device-visible slot map (ABSENT = 0xFFFFFFFF)."""
        return self._s.smap  # type: ignore[no-any-return]

    def where(self, layer: int, expert: int) -> int | None:
        s = int(self._s.where(self._check_layer(layer), self._check_expert(expert)))
        return None if s < 0 else s

    def slot_table(self) -> dict[str, npt.NDArray[Any]]:
        return dict(self._s.slots())

    def slot_bytes(self, slot: int) -> npt.NDArray[np.uint8]:
        """Read-only view of a slot's record bytes (for tests and tools)."""
        return self._s.slot_bytes(int(slot))  # type: ignore[no-any-return]

    def arena_view(self) -> npt.NDArray[np.uint8]:
        """Read-only view of the whole arena, [n_slots, slot_stride] bytes (no copy); slot s
        holds its record at row s. Valid while the stream is open; contents change as slots are
        recycled, so read a slot only while the handshake guarantees it
        (Window.moe_routed_external).
        """
        flat: npt.NDArray[np.uint8] = self._s.arena
        return flat.reshape(self.n_slots, int(self._s.slot_bytes_stride))

    def expert_bytes(self, layer: int, expert: int) -> npt.NDArray[np.uint8] | None:
        """The record bytes of a published expert, or None when it is not published."""
        s = int(self.smap[self.key(layer, expert)])
        return None if s == _core().ABSENT else self.slot_bytes(s)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self._s.stats())
        out["n_slots"] = self.n_slots
        out["direct_io"] = self.direct_io
        return out

    def check_invariants(self) -> str:
        """'' when the engine's own invariant scan (I1, I3-I7) passes, else the violation."""
        return str(self._s.check_invariants())

    # ---- test hooks --------------------------------------------------------------------------
    def pending_io(self) -> list[tuple[int, int, int, ReadClass]]:
        """Queued part reads in the order the IO threads would take them: (slot, key, part, cls)."""
        classes = _core().ReadClass
        return [(s, k, p, classes(c)) for s, k, p, c in self._s.pending_jobs()]

    def run_io(self, index: int = 0) -> bool:
        """Manual IO (io_threads=0): performs the index-th pending part read now."""
        return bool(self._s.run_job(int(index)))

    def inject_fault(
        self,
        layer: int,
        expert: int,
        part: int = -1,
        kind: str = "eio",
        count: int = 1,
        errno_value: int = 5,
        delay_s: float = 0.0,
    ) -> None:
        """Makes the next `count` reads of a record part (-1: any part) misbehave: 'eio' fails
        with errno_value, 'short' returns short, 'delay' stalls delay_s and then reads."""
        kinds = {"eio": 0, "short": 1, "delay": 2}
        if kind not in kinds:
            raise ValueError(f"fault kind must be one of {sorted(kinds)}, got {kind!r}")
        self._s.inject_fault(
            key=self.key(layer, expert),
            part=int(part),
            kind=kinds[kind],
            err=int(errno_value),
            count=int(count),
            delay_ms=int(delay_s * 1000),
        )

    def clear_faults(self) -> None:
        self._s.clear_faults()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.n_slots} slots"
        return f"ExpertStream({str(self.path)!r}, {state})"


__all__ = ["ABSENT", "ExpertStream", "ReadClass", "SlotState", "StreamClosedError"]
