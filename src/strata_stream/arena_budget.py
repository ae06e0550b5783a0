"""How large an arena a pack gets: the bytes asked for, or what available memory allows.

Shared by every front-end (strata_stream.mlx_lm, strata_stream.transformers): it needs neither
MLX nor torch.
"""

from __future__ import annotations

import os

from strata_stream import container_memory
from strata_stream.config import parse_size
from strata_stream.errors import ConfigError
from strata_stream.pack.reader import ExpertPack
from strata_stream.units import human_bytes

_GiB = 1 << 30
# Memory left to the KV cache, activations and the rest of the process when the arena is sized
# automatically: 1 GiB plus a tenth of what is available.
_HEADROOM_FIXED = _GiB
_HEADROOM_SHARE = 0.10


MEMINFO = "/proc/meminfo"  # module-level: tests point it at a file of their own


def available_memory() -> int:
    """Bytes the system can give this process without swapping: MemAvailable on Linux, or what
    its container's memory limit leaves where that is less (a container's processes are killed
    at their limit, however much the machine has free)."""
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
    container = container_memory.available()
    return avail if container is None else min(avail, container)


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


def arena_size(
    pack: ExpertPack,
    requested: int | str | None,
    available: int | None = None,
    memory: str = "memory",
) -> int:
    """The arena for a pack: `requested` if given (bytes, or a size with its unit: "8GB"),
    else what available memory allows after the headroom, capped at every expert resident.
    ConfigError when it cannot hold the minimum (two layers' top_k experts), saying how much
    memory is needed, or when the container cannot hold an explicit one (check_fits).
    available: bytes free (default: host memory, available_memory()); memory names them in that
    error ("GPU memory" for an arena sized from a GPU's)."""
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
        return arena
    avail = available_memory() if available is None else available
    headroom = int(_HEADROOM_FIXED + _HEADROOM_SHARE * avail)
    arena = min(everything, avail - headroom)
    if arena < minimum:
        raise ConfigError(
            f"not enough {memory} for the experts: the arena needs at least {minimum} bytes "
            f"({human_bytes(minimum)}) plus {human_bytes(headroom)} of headroom, "
            f"{human_bytes(minimum + headroom)} in all, but only {human_bytes(avail)} is "
            "available after the dense weights"
        )
    return arena


def ExpertStream_min_slots(top_k: int) -> int:  # noqa: N802 - mirrors ExpertStream::min_slots
    return 2 * top_k


__all__ = ["arena_size", "available_memory", "check_fits", "requested_bytes"]
