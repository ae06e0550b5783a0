"""Test hooks into an ExpertStream's engine, kept off the product's classes.

Tests reach the engine's insides through these functions, each taking the stream it acts on:

- the handshake's steps one at a time, as a Window takes them in order (`request`, `wait`,
  `publish`, `enter_layer`, `after_layer`, `end_turn`, `plan`, `release_plan`, `cancel`,
  `retire_unused_pre`, `release_limbo`, `victim`). Called beside a running Window they corrupt
  its state, which is why the product's ExpertStream does not offer them;
- the stream's maps and record split (`smap`, `key`, `where`, `slot_bytes`, `n_parts`,
  `part_bytes`) and its clients (`n_clients`, `clients_waiting_for_space`);
- a stream whose reads complete without touching the file (`simulated_stream`);
- manual IO: a stream made with ``io_threads=0`` performs a part read only when told
  (`pending_io`, `run_io`);
- read faults: the next reads of a record part fail, come back short or stall
  (`inject_fault`, `clear_faults`);
- eviction by hand (`evict`) and the engine's own invariant scan (`check_invariants`).

They are bound from the extension's ``testing`` submodule (csrc/python/testing.cpp), which
checks every argument.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from strata_stream.config import StreamConfig

if TYPE_CHECKING:  # the extension is imported when a hook is called, not before
    from strata_stream.stream import ExpertStream, ReadClass


def _check_layer(stream: ExpertStream, layer: int) -> int:
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
        raise TypeError(f"layer must be an int, got {type(layer).__name__}")
    if not 0 <= int(layer) < stream.n_layers:
        raise IndexError(f"layer {layer} out of range [0, {stream.n_layers})")
    return int(layer)


def _check_expert(stream: ExpertStream, expert: int) -> int:
    if isinstance(expert, bool) or not isinstance(expert, (int, np.integer)):
        raise TypeError(f"expert must be an int, got {type(expert).__name__}")
    if not 0 <= int(expert) < stream.n_experts:
        raise IndexError(f"expert {expert} out of range [0, {stream.n_experts})")
    return int(expert)


def simulated_stream(
    pack: str | os.PathLike[str] | Any, config: StreamConfig | None = None
) -> ExpertStream:
    """An ExpertStream whose part reads complete without touching the file: the residency code
    at memory speed. Its expert bytes are undefined, so never compute with it."""
    from strata_stream.stream import simulated

    return simulated(pack, config if config is not None else StreamConfig.from_env())


# ---- the handshake's steps ---------------------------------------------------------------------


def request(
    stream: ExpertStream,
    layer: int,
    experts: Any,
    urgent: bool = True,
    cls: ReadClass | None = None,
) -> tuple[int, int, int]:
    """Makes experts resident or loading. Returns (hits, misses, dropped).

    Urgent requests evict as needed; speculative ones (urgent=False, cls PRED1 by default)
    take only free or evictable slots and stop when none is left.
    """
    from strata_stream import _core

    urgent_cls, pred1 = _core.ReadClass.URGENT, _core.ReadClass.PRED1
    read_class = cls if cls is not None else (urgent_cls if urgent else pred1)
    if urgent and cls is not None and cls != _core.ReadClass.URGENT:
        raise ValueError("urgent=True contradicts a speculative cls")
    checked = _check_layer(stream, layer)
    return _core.testing.request(stream._s, checked, experts, _core.ReadClass(int(read_class)))


def wait(stream: ExpertStream, layer: int, experts: Any) -> None:
    """Blocks until the experts are complete and published (requesting any not requested)."""
    from strata_stream import _core

    _core.testing.wait(stream._s, _check_layer(stream, layer), experts)


def publish(stream: ExpertStream, layer: int) -> int:
    """Handshake publication for layers layer+1..layer+2; returns how many were published."""
    from strata_stream import _core

    return _core.testing.publish(stream._s, _check_layer(stream, layer))


def enter_layer(stream: ExpertStream, layer: int, experts: Any = None) -> None:
    """Marks `layer` executing: its slots (or only `experts`, when given) are protected."""
    from strata_stream import _core

    _core.testing.enter_layer(stream._s, _check_layer(stream, layer), experts)


def after_layer(stream: ExpertStream, layer: int) -> None:
    from strata_stream import _core

    _core.testing.after_layer(stream._s, _check_layer(stream, layer))


def end_turn(stream: ExpertStream) -> None:
    from strata_stream import _core

    _core.testing.end_turn(stream._s)


def plan(stream: ExpertStream, layer: int, experts: Any) -> npt.NDArray[np.bool_]:
    """Which experts are resident now; pins them until release_plan() (I8)."""
    from strata_stream import _core

    mask = _core.testing.plan(stream._s, _check_layer(stream, layer), experts)
    return np.asarray(mask, dtype=bool)


def release_plan(stream: ExpertStream) -> None:
    from strata_stream import _core

    _core.testing.release_plan(stream._s)


def cancel(stream: ExpertStream, layer: int, expert: int) -> bool:
    """Cancels a queued read (no part begun). False when it is not cancellable."""
    from strata_stream import _core

    return _core.testing.cancel(stream._s, layer, expert)


def retire_unused_pre(stream: ExpertStream, layer: int, chosen: Any) -> int:
    """Parks this layer's unchosen speculative slots in limbo; returns how many."""
    from strata_stream import _core

    return _core.testing.retire_unused_pre(stream._s, _check_layer(stream, layer), chosen)


def release_limbo(stream: ExpertStream) -> int:
    from strata_stream import _core

    return _core.testing.release_limbo(stream._s)


def victim(stream: ExpertStream, speculative: bool = False) -> int | None:
    """The slot eviction would pick now, or None when none may go."""
    from strata_stream import _core

    v = _core.testing.victim(stream._s, speculative)
    return None if v < 0 else v


# ---- maps, record split, clients -----------------------------------------------------------


def smap(stream: ExpertStream) -> npt.NDArray[np.uint32]:
    """Read-only view of the device-visible slot map (ABSENT = 0xFFFFFFFF)."""
    from strata_stream import _core

    return _core.testing.smap(stream._s)


def key(stream: ExpertStream, layer: int, expert: int) -> int:
    """The smap index of (layer, expert); IndexError when either is out of range."""
    from strata_stream import _core

    return _core.testing.key(stream._s, _check_layer(stream, layer), _check_expert(stream, expert))


def where(stream: ExpertStream, layer: int, expert: int) -> int | None:
    """The slot holding (layer, expert) in any state, or None."""
    from strata_stream import _core

    s = _core.testing.where(stream._s, _check_layer(stream, layer), _check_expert(stream, expert))
    return None if s < 0 else s


def slot_bytes(stream: ExpertStream, slot: int) -> npt.NDArray[np.uint8]:
    """Read-only view of a slot's record bytes."""
    from strata_stream import _core

    return _core.testing.slot_bytes(stream._s, slot)


def n_parts(stream: ExpertStream) -> int:
    """Part reads per expert record."""
    from strata_stream import _core

    return _core.testing.n_parts(stream._s)


def part_bytes(stream: ExpertStream) -> int:
    """The length of each part read but a record's last: config.part_bytes at most, less where
    equal parts spread a record evenly over the IO threads."""
    from strata_stream import _core

    return _core.testing.part_bytes(stream._s)


def n_clients(stream: ExpertStream) -> int:
    """Windows (and the stream itself, once it took a step) registered as clients."""
    from strata_stream import _core

    return _core.testing.n_clients(stream._s)


def clients_waiting_for_space(stream: ExpertStream) -> int:
    from strata_stream import _core

    return _core.testing.clients_waiting_for_space(stream._s)


# ---- manual IO, faults, eviction, invariants -------------------------------------------------


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
    """Evicts the slot `victim()` picks; returns it, or None when none may go."""
    from strata_stream import _core

    slot = _core.testing.evict_one(stream._s)
    return None if slot < 0 else slot


def check_invariants(stream: ExpertStream) -> str:
    """'' when the engine's own invariant scan (I1, I3-I7) passes, else the violation."""
    from strata_stream import _core

    return _core.testing.check_invariants(stream._s)


__all__ = [
    "after_layer",
    "cancel",
    "check_invariants",
    "clear_faults",
    "clients_waiting_for_space",
    "end_turn",
    "enter_layer",
    "evict",
    "inject_fault",
    "key",
    "n_clients",
    "n_parts",
    "part_bytes",
    "pending_io",
    "plan",
    "publish",
    "release_limbo",
    "release_plan",
    "request",
    "retire_unused_pre",
    "run_io",
    "simulated_stream",
    "slot_bytes",
    "smap",
    "victim",
    "wait",
    "where",
]
