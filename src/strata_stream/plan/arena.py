"""The arena a model gets from a memory size: the loader's own rule (arena_budget.arena_size),
asked about a pack that does not exist yet."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from strata_stream import arena_budget
from strata_stream.errors import ConfigError
from strata_stream.pack.geometry import Geometry
from strata_stream.pack.reader import ExpertPack


@dataclass(frozen=True)
class PackShape:
    """What arena_size reads of a pack: its geometry and record stride."""

    geometry: Geometry
    record_stride: int


@dataclass(frozen=True)
class ArenaPlan:
    memory: int  # bytes the process can have (given, or this machine's available memory)
    memory_given: bool  # False: this machine's, as arena_budget.available_memory() says now
    available: int  # memory less the dense weights: what the loader sizes the arena from
    arena_bytes: int | None  # None: not even the minimum arena fits (why says so)
    slots: int
    all_slots: int  # records of the pack: slots for every expert resident
    why: str | None = None


def plan_arena(
    geometry: Geometry,
    record_stride: int,
    dense_bytes: int,
    memory: int | None = None,
    requested: int | None = None,
) -> ArenaPlan:
    """The arena the loaders would make: `requested` bytes (generate's --arena-gb), else what
    `memory` (default: this machine's available memory) leaves once the dense weights are
    loaded, by arena_budget's rule (headroom for the KV cache and the rest, capped at every
    expert resident)."""
    given = memory is not None
    total = arena_budget.available_memory() if memory is None else memory
    available = total - dense_bytes
    shape = cast(ExpertPack, PackShape(geometry, record_stride))  # arena_size reads these two
    all_slots = geometry.n_records
    try:
        if requested is not None:
            arena = arena_budget.arena_size(shape, requested)
        elif available <= 0:
            raise ConfigError(
                f"the dense weights ({dense_bytes} bytes) take all the memory ({total} bytes)"
            )
        else:
            arena = arena_budget.arena_size(shape, None, available=available)
    except ConfigError as e:
        return ArenaPlan(total, given, available, None, 0, all_slots, " ".join(str(e).split()))
    return ArenaPlan(total, given, available, arena, arena // record_stride, all_slots)


__all__ = ["ArenaPlan", "PackShape", "plan_arena"]
