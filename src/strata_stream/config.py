"""StreamConfig: every setting of the engine in one frozen dataclass, and the one reader of
the process environment's STRATA_* variables (docs/settings.md).

Each field is read from STRATA_<FIELD> (upper case); the seed's STRATA_METAL_* names of its
behaviours stay accepted as aliases. `from_env` parses the text, keyword overrides win over the
environment so tests stay hermetic, and the engine's one validate() (exec/window_options.h)
checks every range: StreamConfig fills the C++ StreamOptions and WindowOptions through the
bindings, so a value crosses into C++ once, by the name it has here.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from strata_stream import container_memory
from strata_stream.errors import ConfigError

if TYPE_CHECKING:
    from strata_stream import _core

# The most new two-layer reads a handshake may start (two_layer_max); the seed clamps to it.
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

EVICTION_POLICIES = ("decayed_lfu", "lru")

Kind = Literal["user", "seed", "tuning"]


@dataclass(frozen=True)
class Setting:
    """A StreamConfig field as the environment names it: STRATA_<FIELD>, and the seed's
    STRATA_METAL_* spellings accepted beside it. kind sorts docs/settings.md's tables: user
    settings, the seed's behaviours, and tuning (for benchmarks, not users)."""

    field: str
    kind: Kind
    aliases: tuple[str, ...] = ()

    @property
    def env(self) -> str:
        return "STRATA_" + self.field.upper()

    @property
    def names(self) -> tuple[str, ...]:
        return (self.env, *self.aliases)


SETTINGS: tuple[Setting, ...] = (
    # User settings (docs/settings.md, first table).
    Setting("arena_bytes", "user"),
    Setting("io_threads", "user"),
    Setting("direct_io", "user"),
    Setting("verify_reads", "user"),
    Setting("eviction", "user"),
    Setting("trace_path", "user"),
    Setting("max_rows", "user"),
    Setting("moce", "user"),
    # The seed's behaviours, by their clearer names; the seed's own names are aliases.
    Setting("publish_prefetch", "seed", ("STRATA_METAL_PUBLISH_PREFETCH",)),
    Setting("two_layer_prompt", "seed", ("STRATA_METAL_PROMPT_PRED2",)),
    Setting("two_layer_max", "seed", ("STRATA_METAL_PROMPT_PRED2_MAX",)),
    Setting("start_layers", "seed", ("STRATA_METAL_PROMPT_START_LAYERS",)),
    Setting("prompt_buf_reuse", "seed", ("STRATA_METAL_PROMPT_BUF_REUSE",)),
    Setting("two_layer_decode", "seed", ("STRATA_METAL_PREFETCH2",)),
    Setting("split_turn", "seed"),
    # Tuning: for benchmarks and tests.
    Setting("part_bytes", "tuning"),
    Setting("io_spin_us", "tuning"),
    Setting("io_timeout_s", "tuning"),
    Setting("lookahead", "tuning"),
    Setting("profile_prefetch", "tuning"),
    Setting("prefetch_backoff", "tuning"),
    Setting("decode_rows", "tuning"),
    Setting("decode_batch_rows", "tuning"),
    Setting("device_timeout_s", "tuning"),
    Setting("persist_profile", "tuning"),
    Setting("moce_strength", "tuning"),
    Setting("moce_keep_top", "tuning"),
)

# field name -> its environment variable.
ENV_FLAGS: dict[str, str] = {s.field: s.env for s in SETTINGS}

# Settings outside StreamConfig, read here too so that this module alone reads STRATA_*.
CACHE_ENV = "STRATA_CACHE"  # where converted packs go (paths.cache_dir)
LOCAL_RANKS_ENV = "STRATA_LOCAL_RANKS"  # ranks on this machine (mlx_lm.distributed)


def cache_dir_env(env: Mapping[str, str] | None = None) -> str | None:
    """$STRATA_CACHE, or None when unset or empty."""
    return (os.environ if env is None else env).get(CACHE_ENV) or None


def local_ranks_env(env: Mapping[str, str] | None = None) -> int | None:
    """$STRATA_LOCAL_RANKS as a count of at least 1, or None when unset or empty."""
    text = (os.environ if env is None else env).get(LOCAL_RANKS_ENV)
    if not text:
        return None
    try:
        n = int(text)
    except ValueError:
        raise ConfigError(f"{LOCAL_RANKS_ENV} must be an integer, got {text!r}") from None
    if n < 1:
        raise ConfigError(f"{LOCAL_RANKS_ENV} must be at least 1, got {n}")
    return n


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


def _parse_setting(field: str, text: str, var: str) -> Any:
    """The environment text of a StreamConfig field as the field's type; ConfigError naming
    the variable where it cannot be read. Ranges are the engine's validate()'s to check."""
    if field in ("arena_bytes", "part_bytes"):
        return parse_size(text, var)
    if field in ("trace_path", "eviction"):
        return text
    if field == "moce":
        return text.strip().lower()
    if field == "direct_io":
        auto = text.strip().lower() == "auto"
        return None if auto else _parse_bool(text, var + " (or auto)")
    kind = _FIELD_TYPES[field]
    if kind == "bool":
        return _parse_bool(text, var)
    if kind in ("float", "float | None"):
        return _parse_float(text, var)
    return _parse_int(text, var)


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
    # Publish completed prefetches of layers l+1..l+2 at each handshake (the seed's behaviour).
    publish_prefetch: bool = True
    # Two-layer lookahead (router l+2 on layer l's input too) for chunks larger than decode_rows
    # (two_layer_prompt) and for decode-sized ones (two_layer_decode), on every expert path; at
    # most two_layer_max new two-layer reads per handshake (clamped to 0..PRED2_MAX_LIMIT, as
    # the seed does).
    two_layer_prompt: bool = False
    two_layer_max: int = 64
    # At turn start, queue the profile's most popular experts of layers 0..start_layers-1.
    start_layers: int = 1
    # Keep the prompt scratch across turns instead of releasing it when a turn ends.
    prompt_buf_reuse: bool = False
    two_layer_decode: bool = False
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
        # What has no C++ field is checked here; every other value is converted by the bindings
        # and checked by the engine's validate(), each naming the field.
        if self.direct_io is not None and not isinstance(self.direct_io, bool):
            raise ConfigError(f"direct_io: expected a bool or None (auto), got {self.direct_io!r}")
        if self.trace_path is not None and not isinstance(self.trace_path, str):
            raise ConfigError(f"trace_path: expected a path string, got {self.trace_path!r}")
        if not isinstance(self.persist_profile, bool):
            raise ConfigError(f"persist_profile: expected a bool, got {self.persist_profile!r}")
        strength = self.moce_strength
        if strength is not None and (
            isinstance(strength, bool) or not isinstance(strength, numbers.Real)
        ):
            raise ConfigError(f"moce_strength: expected a number or None, got {strength!r}")
        # The seed clamps PRED2_MAX rather than rejecting it; keep that contract.
        n = self.two_layer_max
        if isinstance(n, int) and not isinstance(n, bool):
            object.__setattr__(self, "two_layer_max", min(max(n, 0), PRED2_MAX_LIMIT))
        self.stream_options(direct_io=False).validate()
        self.window_options().validate()

    def stream_options(self, direct_io: bool, simulate_io: bool = False) -> _core.StreamOptions:
        """The C++ StreamOptions of this config, with direct_io decided (direct_io_for)."""
        from strata_stream import _core

        o = _core.StreamOptions()
        o.arena_bytes = self.arena_bytes
        o.io_threads = self.io_threads
        o.part_bytes = self.part_bytes
        o.io_spin_us = self.io_spin_us
        o.direct_io = direct_io
        o.verify_reads = self.verify_reads
        o.io_timeout_s = self.io_timeout_s
        o.publish_prefetch = self.publish_prefetch
        o.simulate_io = simulate_io
        o.eviction = self.eviction
        return o

    def window_options(self) -> _core.WindowOptions:
        """The C++ WindowOptions of this config (the pack's own limits are checked when a
        Window is made)."""
        from strata_stream import _core

        o = _core.WindowOptions()
        o.lookahead = self.lookahead
        o.split_turn = self.split_turn
        o.max_rows = self.max_rows
        o.decode_rows = self.decode_rows
        o.decode_batch_rows = self.decode_batch_rows
        o.device_timeout_s = self.device_timeout_s
        o.two_layer_prompt = self.two_layer_prompt
        o.two_layer_max = self.two_layer_max
        o.two_layer_decode = self.two_layer_decode
        o.prompt_buf_reuse = self.prompt_buf_reuse
        o.record_routes = self.trace_path is not None
        o.start_layers = self.start_layers
        o.moce = self.moce
        o.moce_strength = self.moce_strength_value
        o.moce_keep_top = self.moce_keep_top
        o.profile_prefetch = self.profile_prefetch
        o.prefetch_backoff = self.prefetch_backoff
        return o

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> StreamConfig:
        """Defaults, then the environment (STRATA_<FIELD>, or a seed alias), then keyword
        overrides. A setting given by two names with different values is a ConfigError naming
        both."""
        source = os.environ if env is None else env
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise ConfigError(f"StreamConfig has no field {', '.join(unknown)}")
        values: dict[str, Any] = {}
        for setting in SETTINGS:
            if setting.field in overrides:
                continue
            given = [(var, source[var]) for var in setting.names if var in source]
            if not given:
                continue
            parsed = [(var, _parse_setting(setting.field, text, var)) for var, text in given]
            var, value = parsed[0]
            for other, other_value in parsed[1:]:
                if other_value != value:
                    raise ConfigError(
                        f"{var}={source[var]!r} and {other}={source[other]!r} set "
                        f"{setting.field} differently; set one of them"
                    )
            values[setting.field] = value
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
            return MOCE_DEFAULT_STRENGTH.get(self.moce, 1.0)  # the binding names a bad mode
        return float(self.moce_strength)

    def replace(self, **changes: Any) -> StreamConfig:
        return dataclasses.replace(self, **changes)


# Each field's annotation, as text (from __future__ annotations), for _parse_setting.
_FIELD_TYPES: dict[str, str] = {f.name: str(f.type) for f in dataclasses.fields(StreamConfig)}
