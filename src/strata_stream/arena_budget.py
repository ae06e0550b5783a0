"""How large an arena a pack gets: the bytes asked for, or what available memory allows.

Shared by every front-end (strata_stream.mlx_lm, strata_stream.transformers): it needs neither
MLX nor torch. The dense weights a front-end holds are counted once (ArenaBudget): the
transformers front-end makes the ones a step reads whole resident before sizing, so the
container's charge holds them, and reports the rows a step reads of an embedding it leaves
mapped as the part not yet held (dense_pending).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from strata_stream import container_memory
from strata_stream.config import parse_size
from strata_stream.errors import ConfigError
from strata_stream.pack.reader import ExpertPack
from strata_stream.units import human_bytes

_MiB = 1 << 20
# What an automatically sized arena leaves, besides what the process already holds (the dense
# weights among it), as shares of what that leaves of the memory it is taken from (a
# container's limit, else the memory available):
KV_SHARE = 0.10  # the KV cache and the front-end's activations, which grow after sizing
MARGIN_SHARE = 0.05  # the stated margin: allocator slack, thread stacks, libraries' caches
MARGIN_MIN = 64 * _MiB
MAX_ROWS = 1024  # the rows of a prompt chunk the engine's scratch is sized for (StreamConfig)


MEMINFO = "/proc/meminfo"  # module-level: tests point it at a file of their own


def available_memory() -> int:
    """Bytes the system can give this process without swapping: MemAvailable on Linux, or what
    its container's memory limit leaves where that is less (a container's processes are killed
    at their limit, however much the machine has free)."""
    avail = machine_available()
    container = container_memory.available()
    return avail if container is None else min(avail, container)


def machine_available() -> int:
    """The machine's MemAvailable (page cache it can drop counted as free), or half its memory
    where there is no such figure."""
    avail: int | None = None
    try:
        with open(MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if avail is None:
        pages = os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
        avail = int(pages * os.sysconf("SC_PAGE_SIZE") // 2)  # no better figure: half of RAM
    return avail


def check_fits(arena: int, name: str = "arena_bytes") -> None:
    """ConfigError when an arena of `arena` bytes cannot fit the memory this process's container
    has left (its limit less what it uses now): there the kernel would kill the process while
    the arena fills, with no message. Called before anything is mapped. Nothing where there is
    no container limit."""
    bound = container_memory.binding()
    if bound is None:
        return
    cap, left = bound
    if arena > left:
        raise ConfigError(
            f"{name} {human_bytes(arena)} ({arena} bytes) does not fit this container's memory: "
            f"{human_bytes(left)} ({left} bytes) is left of its {human_bytes(cap)} limit, and the "
            "kernel kills a process that goes over it; ask for a smaller arena, or leave it "
            "unset to size it from the memory left"
        )


def requested_bytes(requested: int | str | None, name: str = "arena_bytes") -> int | None:
    """An arena size as a caller gives it: bytes (an int), a size with its unit ("8GB",
    "512MiB", "2G": binary units, as StreamConfig's environment flags read them) or None;
    anything else is a ConfigError naming `name`."""
    if requested is None:
        return None
    if isinstance(requested, str):
        return parse_size(requested, name)
    if isinstance(requested, bool) or not isinstance(requested, int):
        raise ConfigError(
            f"{name} must be a number of bytes or a size such as '8GB' or '512MiB', got "
            f"{requested!r}"
        )
    return requested


@dataclass(frozen=True)
class ArenaBudget:
    """How an arena was sized, in bytes. Automatic sizing:

        arena = memory - in_use - scratch - kv - margin   (at most every expert resident)

    memory: a container's memory limit where one binds (else the memory available: the
    machine's MemAvailable, or a GPU's free memory); in_use: what the container holds now that
    the kernel cannot reclaim, the dense weights the front-end has loaded among it (0 outside a
    container, where `memory` is already what is free); scratch: the engine's buffers for a
    prompt chunk of MAX_ROWS rows; kv: KV_SHARE of what is left (memory - in_use), for the KV
    cache and activations; margin: MARGIN_SHARE of it, at least MARGIN_MIN. dense: the bytes of
    the dense weights the front-end reported holding; they are counted once, inside in_use
    where they are resident, and only the part in_use does not hold yet where they are not.
    dense_pending: that part, where the front-end knows it; in_use is then the container's
    charge plus it. The transformers front-end (transformers/dense_memory.py) copies the
    weights a step reads whole out of the checkpoint's file mapping into anonymous memory
    before sizing, where the charge holds them and the kernel cannot drop them, and leaves an
    embedding a step reads by rows mapped, counted as one prompt chunk's rows: that is its
    pending part. Without dense_pending, in_use is the larger of the charge and dense (a
    front-end whose weights may or may not be resident yet)."""

    arena: int
    source: str  # "requested", "container", or what `memory` is ("memory", "GPU memory")
    memory: int
    in_use: int = 0
    dense: int | None = None
    scratch: int = 0
    kv: int = 0
    margin: int = 0
    dense_pending: int | None = None

    @property
    def headroom(self) -> int:
        """What the arena leaves of what is left: scratch, KV cache, margin."""
        return self.scratch + self.kv + self.margin

    def as_dict(self) -> dict[str, int | str | None]:
        return {
            "arena_bytes": self.arena,
            "arena_source": self.source,
            "memory_bytes": self.memory,
            "in_use_bytes": self.in_use,
            "dense_bytes": self.dense,
            "scratch_bytes": self.scratch,
            "kv_bytes": self.kv,
            "margin_bytes": self.margin,
            "dense_pending_bytes": self.dense_pending,
        }


def scratch_bytes(pack: ExpertPack, rows: int = MAX_ROWS) -> int:
    """The engine's working buffers for a chunk of `rows` rows (float32 x and out, the routed
    ids and weights, router logits and two layers' predictions, the experts' activations and
    weighted outputs): docs/architecture.md, "Scratch"."""
    g = pack.geometry
    per_row = 4 * (2 * g.hidden + 3 * g.n_experts + g.top_k * (2 * g.moe_intermediate + g.hidden))
    return rows * (per_row + 8 * g.top_k)


def budget(
    pack: ExpertPack,
    requested: int | str | None,
    available: int | None = None,
    memory: str = "memory",
    dense_bytes: int | None = None,
    dense_pending: int | None = None,
) -> ArenaBudget:
    """The arena for a pack and how it was sized (ArenaBudget): `requested` if given (bytes, or
    a size with its unit: "8GB"), else what the memory leaves after what is in use, the scratch,
    the KV cache's share and the margin, capped at every expert resident. ConfigError when it
    cannot hold the minimum (two layers' top_k experts), saying how much memory is needed and
    where it went, or when the container cannot hold an explicit one (check_fits).
    available: bytes free (default: this machine's memory, within its container's limit);
    memory names them in that error ("GPU memory" for an arena sized from a GPU's).
    dense_bytes: the front-end's dense weights, reported, and counted where not yet resident;
    dense_pending: the part of them not yet resident, where the front-end knows it (ArenaBudget)."""
    requested = requested_bytes(requested)
    g = pack.geometry
    stride = pack.record_stride
    minimum = ExpertStream_min_slots(g.top_k) * stride
    everything = g.n_records * stride
    if requested is not None:
        if requested < minimum:
            raise ConfigError(
                f"arena_bytes {requested} is below the minimum {minimum} bytes "
                f"({human_bytes(minimum)}: {ExpertStream_min_slots(g.top_k)} expert records "
                f"of {stride} bytes)"
            )
        arena = min(requested, everything)
        check_fits(arena)
        return ArenaBudget(
            arena, "requested", arena, dense=dense_bytes, dense_pending=dense_pending
        )
    for name, value in (("dense_bytes", dense_bytes), ("dense_pending", dense_pending)):
        if value is not None and value < 0:
            raise ConfigError(f"{name} must be >= 0, got {value}")
    total, in_use, source = _memory(available, memory, dense_bytes, dense_pending)
    scratch = min(scratch_bytes(pack), everything)
    left = total - in_use
    # Shares of what is left, not of the whole: under a tight limit the dense weights already
    # hold most of it, and what they leave is what the KV cache and the arena split
    # (benchmarks/peers at 2 GiB measures the difference).
    kv = int(KV_SHARE * max(left, 0))
    margin = max(MARGIN_MIN, int(MARGIN_SHARE * max(left, 0)))
    arena = min(everything, left - scratch - kv - margin)
    found = ArenaBudget(
        arena, source, total, in_use, dense_bytes, scratch, kv, margin, dense_pending
    )
    if arena < minimum:
        where = (
            f"of this container's {human_bytes(total)} limit, {human_bytes(in_use)} is in use "
            f"(the dense weights among it), so only {human_bytes(left)} is left"
            if source == "container"
            else f"only {human_bytes(left)} is available after the dense weights"
        )
        raise ConfigError(
            f"not enough {memory} for the experts: the arena needs at least {minimum} bytes "
            f"({human_bytes(minimum)}) plus {human_bytes(found.headroom)} of headroom "
            f"({human_bytes(scratch)} scratch, {human_bytes(kv)} KV cache and activations, "
            f"{human_bytes(margin)} margin), {human_bytes(minimum + found.headroom)} in all, but "
            f"{where} (an explicit arena_bytes is taken as given, where the headroom is more "
            "than this model needs)"
        )
    return found


def _memory(
    available: int | None, memory: str, dense: int | None, pending: int | None
) -> tuple[int, int, str]:
    """(memory the arena is taken from, bytes of it in use, its source) for budget()."""
    if available is not None:  # a figure of free memory the caller measured (a GPU's)
        return available, 0, memory
    machine = machine_available()
    found = container_memory.usage()
    if found is not None:
        # The dense weights are in the container's charge once loaded (anonymous memory, or
        # mapped file pages): counted there, plus the part the front-end says is not yet; or,
        # where it cannot say, by its whole figure while the charge is less.
        in_use = found.in_use + pending if pending is not None else max(found.in_use, dense or 0)
        if found.limit - in_use <= machine:
            return found.limit, in_use, "container"
    return machine, 0, memory


def arena_size(
    pack: ExpertPack,
    requested: int | str | None,
    available: int | None = None,
    memory: str = "memory",
    dense_bytes: int | None = None,
    dense_pending: int | None = None,
) -> int:
    """budget(...).arena: the arena's bytes alone."""
    return budget(pack, requested, available, memory, dense_bytes, dense_pending).arena


def ExpertStream_min_slots(top_k: int) -> int:  # noqa: N802 - mirrors ExpertStream::min_slots
    return 2 * top_k


__all__ = [
    "ArenaBudget",
    "arena_size",
    "available_memory",
    "budget",
    "check_fits",
    "machine_available",
    "requested_bytes",
    "scratch_bytes",
]
