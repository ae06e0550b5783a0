"""Test hooks into an ExpertStream's engine, kept off the product's classes.

Tests (and the trace replay, which drives IO by hand) reach the engine's insides through these
functions, each taking the stream it acts on:

- manual IO: a stream made with ``io_threads=0`` performs a part read only when told
  (`pending_io`, `run_io`);
- read faults: the next reads of a record part fail, come back short or stall
  (`inject_fault`, `clear_faults`);
- eviction by hand (`evict`) and the engine's own invariant scan (`check_invariants`).

They are bound from the extension's ``testing`` submodule (csrc/python/testing.cpp), which
checks every argument.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the extension is imported when a hook is called, not before
    from strata_stream.stream import ExpertStream, ReadClass


def pending_io(stream: ExpertStream) -> list[tuple[int, int, int, ReadClass]]:
    """Queued part reads in the order the IO threads would take them: (slot, key, part, cls)."""
    from strata_stream import _core

    return _core.testing.pending_jobs(stream._s)


def run_io(stream: ExpertStream, index: int = 0) -> bool:
    """Manual IO (io_threads=0): performs the index-th pending part read now; False when there
    is none."""
    from strata_stream import _core

    return _core.testing.run_job(stream._s, index)


def inject_fault(
    stream: ExpertStream,
    layer: int,
    expert: int,
    part: int = -1,
    kind: str = "eio",
    count: int = 1,
    errno_value: int = 5,
    delay_s: float = 0.0,
) -> None:
    """Makes the next `count` reads (-1: every read) of a record part (-1: any part) of
    (layer, expert) misbehave: 'eio' fails with errno_value, 'short' returns short, 'delay'
    stalls delay_s and then reads."""
    from strata_stream import _core

    _core.testing.inject_fault(
        stream._s,
        layer=layer,
        expert=expert,
        part=part,
        kind=kind,
        count=count,
        errno_value=errno_value,
        delay_s=delay_s,
    )


def clear_faults(stream: ExpertStream) -> None:
    """Removes every injected fault."""
    from strata_stream import _core

    _core.testing.clear_faults(stream._s)


def evict(stream: ExpertStream) -> int | None:
    """Evicts the slot `ExpertStream.victim()` picks; returns it, or None when none may go."""
    from strata_stream import _core

    slot = _core.testing.evict_one(stream._s)
    return None if slot < 0 else slot


def check_invariants(stream: ExpertStream) -> str:
    """'' when the engine's own invariant scan (I1, I3-I7) passes, else the violation."""
    from strata_stream import _core

    return _core.testing.check_invariants(stream._s)


__all__ = [
    "check_invariants",
    "clear_faults",
    "evict",
    "inject_fault",
    "pending_io",
    "run_io",
]
