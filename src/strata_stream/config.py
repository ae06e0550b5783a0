"""StreamConfig: every knob of the engine in one frozen dataclass.

The seed's environment flags (docs/architecture.md section 6) keep their names and
defaults; `from_env` reads them so a deployment can flip a policy without touching code, and
keyword overrides win over the environment so tests stay hermetic.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from strata_stream import container_memory
from strata_stream.errors import ConfigError
from strata_stream.pack.header import PAGE

PRED2_MAX_LIMIT = 512
MOCE_MODES = ("off", "scale", "prune")
# moce_strength when left unset: a resident expert's probability counts double (scale), a cold
# expert below 5% router probability gives way to a resident one (prune).
MOCE_DEFAULT_STRENGTH = {"off": 1.0, "scale": 2.0, "prune": 0.05}

# direct_io=None reads a pack through the page cache when it fits this fraction of the memory
# (memory_bytes: the machine's, or a smaller container limit; StreamConfig.direct_io_for).
AUTO_BUFFERED_MEMORY_FRACTION = 0.25

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}

# field name -> environment variable. The STRATA_METAL_* names are the seed's.
EVICTION_POLICIES = ("decayed_lfu", "lru")

ENV_FLAGS: dict[str, str] = {
    "arena_bytes": "STRATA_ARENA_BYTES",
    "io_threads": "STRATA_IO_THREADS",
    "part_bytes": "STRATA_PART_BYTES",
    "io_spin_us": "STRATA_IO_SPIN_US",
    "direct_io": "STRATA_DIRECT_IO",
    "verify_reads": "STRATA_VERIFY_READS",
    "publish_prefetch": "STRATA_METAL_PUBLISH_PREFETCH",
    "prompt_pred2": "STRATA_METAL_PROMPT_PRED2",
    "prompt_pred2_max": "STRATA_METAL_PROMPT_PRED2_MAX",
    "prompt_start_layers": "STRATA_METAL_PROMPT_START_LAYERS",
    "prompt_buf_reuse": "STRATA_METAL_PROMPT_BUF_REUSE",
    "decode_prefetch2": "STRATA_METAL_PREFETCH2",
    "lookahead": "STRATA_LOOKAHEAD",
    "profile_prefetch": "STRATA_PROFILE_PREFETCH",
    "prefetch_backoff": "STRATA_PREFETCH_BACKOFF",
    "split_turn": "STRATA_SPLIT_TURN",
    "max_rows": "STRATA_MAX_ROWS",
    "trace_path": "STRATA_TRACE_PATH",
    "eviction": "STRATA_EVICTION",
    "moce": "STRATA_MOCE",
    "moce_strength": "STRATA_MOCE_STRENGTH",
    "moce_keep_top": "STRATA_MOCE_KEEP_TOP",
}


def parse_size(text: str, what: str) -> int:
    """'2GiB', '512m', '1048576' -> bytes; anything else is a ConfigError naming `what`."""
    match = _SIZE.match(text)
    if not match:
        raise ConfigError(f"{what}: cannot read {text!r} as a size (e.g. 4096, 512MiB, 2G)")
    number, unit, _ = match.groups()
    return int(float(number) * _SIZE_UNITS[unit.lower()])


def memory_bytes() -> int | None:
    """The memory this process's page cache may use: the machine's physical memory (Linux and
    macOS) or a smaller container limit; None where neither is known."""
    total: int | None = None
    try:
        pages, page = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        if pages > 0 and page > 0:
            total = pages * page
    except (AttributeError, ValueError, OSError):
        pass
    container = container_memory.limit()
    if container is not None:
        total = container if total is None else min(total, container)
    return total


def _parse_bool(text: str, what: str) -> bool:
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ConfigError(f"{what}: expected 0/1/true/false, got {text!r}")


def _parse_float(text: str, what: str) -> float:
    try:
        return float(text.strip())
    except ValueError:
        raise ConfigError(f"{what}: expected a number, got {text!r}") from None


def _parse_int(text: str, what: str) -> int:
    try:
        return int(text.strip(), 0)
    except ValueError:
        raise ConfigError(f"{what}: expected an integer, got {text!r}") from None


def _usable_cores() -> int:
    # The cores this process may run on (a container's or taskset's share), where the OS says.
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity else os.cpu_count() or 4


# IO threads by default: one a core from 4 to 8 (docs/cuda.md, "IO threads and part size").
DEFAULT_IO_THREADS = min(8, max(4, _usable_cores()))


@dataclass(frozen=True)
class StreamConfig:
    """How an ExpertStream (and the Window above it) runs.

    arena_bytes bounds the expert memory: it becomes arena_bytes // record_stride slots.
    """

    arena_bytes: int = 1 << 30
    # A miss waits for its record's slowest IO thread, so records are split finely enough to
    # spread over all of them: 8 threads of 256 KiB parts (balanced) made a 2.5 MiB q4 miss
    # 0.58 -> 0.30 ms against 4 of 1 MiB on the H200 machine's 16 cores, and decode 1.05-1.43x
    # faster there (docs/cuda.md, "IO threads and part size"). A pread from the page cache is
    # CPU work, so threads beyond the cores only queue: DEFAULT_IO_THREADS is 4 to 8 by the
    # core count.
    # part_bytes is the largest part: the stream splits a record into equal parts, their count
    # a multiple of io_threads where the parts stay at least 64 KiB (ExpertStream.part_bytes).
    io_threads: int = DEFAULT_IO_THREADS
    part_bytes: int = 256 << 10
    # How long an IO thread out of jobs, and an urgent wait whose reads are in flight, spin
    # before sleeping (0, the default: never). A lone miss then skips its futex wakes (on the
    # H200 machine 200 us made a q4 miss 0.33 -> 0.29 ms), but each spinner holds a core: decode
    # was no faster there, and a 2-core VM's miss 35% slower (docs/cuda.md, "Spinning IO").
    io_spin_us: int = 0
    # Read the pack around the page cache (O_DIRECT; F_NOCACHE on macOS): True, False, or None
    # (the default), which decides by the pack's size (direct_io_for). Direct reads are what a
    # pack bigger than memory needs: through the page cache every read would be copied twice
    # and evict other data, the pack's own records first. A pack that fits a quarter of the
    # memory (the machine's, or a smaller container limit: memory_bytes) is read through the
    # page cache instead, which then holds all of it: a miss is a memory copy, not a device
    # read (on a VM each direct read is also a VM exit).
    direct_io: bool | None = None
    # Check every expert read against the pack's CRC32C: a record that changed on disk is an
    # ExpertReadError, not silently wrong output. Hardware CRC32C, computed outside the stream's
    # lock, costs about 1% of decode tokens/s (benchmarks/decode.py --verify-cost).
    verify_reads: bool = True
    io_timeout_s: float = 60.0
    publish_prefetch: bool = True
    # Two-layer lookahead (router l+2 on layer l's input too) for chunks larger than decode_rows
    # (prompt_pred2) and for decode-sized ones (decode_prefetch2), on every expert path; at most
    # prompt_pred2_max new two-layer reads per handshake. The names are the flags' (section 6).
    prompt_pred2: bool = False
    prompt_pred2_max: int = 64
    prompt_start_layers: int = 1
    prompt_buf_reuse: bool = False
    decode_prefetch2: bool = False
    lookahead: bool = True
    # With lookahead off, queue the next layer's most popular experts (by the profile) at each
    # handshake, as speculative Profile reads (docs/architecture.md section 6).
    profile_prefetch: bool = True
    # Cap speculative reads when they do not pay (low precision, or urgent reads waiting behind
    # speculation on a busy SSD); see csrc/engine/prefetch_governor.h. Window.stats()["prefetch"]
    # reports the governor's state and cap.
    prefetch_backoff: bool = True
    split_turn: bool = False
    max_rows: int = 1024  # rows per prompt chunk; the engine checks it when a Window opens
    decode_rows: int = 4
    # A routed call (mlx-lm's model routing B sequences at once) of up to this many rows stays on
    # the decode path while the union of its experts fits one decode submission.
    decode_batch_rows: int = 64
    device_timeout_s: float = 600.0
    # A Window records every routed choice to this file (strata_trace v1, see replay.py), for
    # `strata-stream replay`. Written anew by each Window.
    trace_path: str | None = None
    # Load and save the expert popularity profile beside the pack (`<pack>.profile.npy`); off,
    # each Window learns one from scratch and forgets it.
    persist_profile: bool = True
    # Which evictable slot gives way to a new read (see csrc/engine/eviction_policy.h):
    # "decayed_lfu" (the expert used least, with uses decaying over ~16 tokens, never one used
    # or predicted in the last token) or "lru".
    eviction: str = "decayed_lfu"
    # Cache-aware routing (docs/architecture.md section 6): "off" routes exactly; "scale"
    # multiplies resident experts' router probabilities by moce_strength before the top-k;
    # "prune" replaces a nonresident choice whose probability is below moce_strength by the best
    # resident expert.
    # The true top moce_keep_top are always kept. None = the mode's default strength.
    moce: str = "off"
    moce_strength: float | None = None
    moce_keep_top: int = 2

    def __post_init__(self) -> None:
        for name in (
            "arena_bytes",
            "io_threads",
            "part_bytes",
            "io_spin_us",
            "prompt_pred2_max",
            "prompt_start_layers",
            "moce_keep_top",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"StreamConfig.{name}: expected int, got {value!r}")
        if self.direct_io is not None and not isinstance(self.direct_io, bool):
            raise ConfigError(
                f"StreamConfig.direct_io: expected bool or None (auto), got {self.direct_io!r}"
            )
        for name in (
            "verify_reads",
            "publish_prefetch",
            "prompt_pred2",
            "prompt_buf_reuse",
            "decode_prefetch2",
            "profile_prefetch",
            "prefetch_backoff",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(
                    f"StreamConfig.{name}: expected bool, got {getattr(self, name)!r}"
                )
        if self.arena_bytes <= 0:
            raise ConfigError(f"StreamConfig.arena_bytes: must be positive, got {self.arena_bytes}")
        if not 0 <= self.io_threads <= 256:
            raise ConfigError(
                f"StreamConfig.io_threads: must be 0..256 (0 = manual IO for tests), "
                f"got {self.io_threads}"
            )
        if self.part_bytes <= 0 or self.part_bytes % PAGE:
            raise ConfigError(
                f"StreamConfig.part_bytes: must be a positive multiple of {PAGE}, "
                f"got {self.part_bytes}"
            )
        if self.trace_path is not None and not isinstance(self.trace_path, str):
            raise ConfigError(
                f"StreamConfig.trace_path: expected a path string, got {self.trace_path!r}"
            )
        if self.eviction not in EVICTION_POLICIES:
            raise ConfigError(
                f"StreamConfig.eviction: expected one of {', '.join(EVICTION_POLICIES)}, "
                f"got {self.eviction!r}"
            )
        if not 0 <= self.io_spin_us <= 100_000:
            raise ConfigError(
                f"StreamConfig.io_spin_us: must be 0..100000 (microseconds), got {self.io_spin_us}"
            )
        if self.decode_rows < 0:
            raise ConfigError(f"StreamConfig.decode_rows: must be >= 0, got {self.decode_rows}")
        if self.decode_batch_rows < 0:
            raise ConfigError(
                f"StreamConfig.decode_batch_rows: must be >= 0, got {self.decode_batch_rows}"
            )
        if not self.device_timeout_s > 0:
            raise ConfigError(
                f"StreamConfig.device_timeout_s: must be positive, got {self.device_timeout_s}"
            )
        if not self.io_timeout_s > 0:
            raise ConfigError(
                f"StreamConfig.io_timeout_s: must be positive, got {self.io_timeout_s}"
            )
        if self.prompt_start_layers < 0:
            raise ConfigError(
                f"StreamConfig.prompt_start_layers: must be >= 0, got {self.prompt_start_layers}"
            )
        if self.moce not in MOCE_MODES:
            raise ConfigError(
                f"StreamConfig.moce: must be one of {', '.join(MOCE_MODES)}, got {self.moce!r}"
            )
        if self.moce_strength is not None:
            s = self.moce_strength
            if isinstance(s, bool) or not isinstance(s, (int, float)):
                raise ConfigError(f"StreamConfig.moce_strength: expected a number, got {s!r}")
            if not (math.isfinite(s) and s >= 0):
                raise ConfigError(f"StreamConfig.moce_strength: must be finite and >= 0, got {s}")
        if self.moce_keep_top < 0:
            raise ConfigError(f"StreamConfig.moce_keep_top: must be >= 0, got {self.moce_keep_top}")
        # The seed clamps PRED2_MAX rather than rejecting it; keep that contract.
        clamped = min(max(self.prompt_pred2_max, 0), PRED2_MAX_LIMIT)
        object.__setattr__(self, "prompt_pred2_max", clamped)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> StreamConfig:
        """Defaults, then the environment flags, then keyword overrides."""
        source = os.environ if env is None else env
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise ConfigError(f"StreamConfig has no field {', '.join(unknown)}")
        values: dict[str, Any] = {}
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        for name, var in ENV_FLAGS.items():
            text = source.get(var)
            if text is None or name in overrides:
                continue
            kind = types[name]
            if name in ("arena_bytes", "part_bytes"):
                values[name] = parse_size(text, var)
            elif name in ("trace_path", "eviction"):
                values[name] = text
            elif name == "moce":
                values[name] = text.strip().lower()
            elif name == "moce_strength":
                values[name] = _parse_float(text, var)
            elif name == "direct_io":
                auto = text.strip().lower() == "auto"
                values[name] = None if auto else _parse_bool(text, var + " (or auto)")
            elif kind in ("bool", bool):
                values[name] = _parse_bool(text, var)
            else:
                values[name] = _parse_int(text, var)
        values.update(overrides)
        return cls(**values)

    def direct_io_for(self, pack_bytes: int) -> bool:
        """Whether a pack of pack_bytes is read directly: direct_io where set, else (auto) when
        the pack is larger than AUTO_BUFFERED_MEMORY_FRACTION of memory_bytes() (or that is
        unknown)."""
        if self.direct_io is not None:
            return self.direct_io
        memory = memory_bytes()
        return memory is None or pack_bytes > memory * AUTO_BUFFERED_MEMORY_FRACTION

    @property
    def moce_strength_value(self) -> float:
        """moce_strength, or the mode's default when unset."""
        if self.moce_strength is None:
            return MOCE_DEFAULT_STRENGTH[self.moce]
        return float(self.moce_strength)

    def replace(self, **changes: Any) -> StreamConfig:
        return dataclasses.replace(self, **changes)
