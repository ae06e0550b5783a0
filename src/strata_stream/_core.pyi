# Types of the compiled extension strata_stream._core (csrc/python/: one binding file per
# concept, named beside each section below). mypy checks the Python layer's calls into it
# against these; keep them in step with the bindings.
from collections.abc import Callable
from enum import IntEnum
from typing import Any, TypedDict, overload

import numpy as np
import numpy.typing as npt
from typing_extensions import Buffer

# ---- pack.cpp ------------------------------------------------------------------------------

# Every field a pack's header stores or implies (what pack/header.py reads through), format
# codes as stored: each class's formats (weight_format, group_size, scale_format of gate, up,
# down) and tensor table ((matrix, role, offset, nbytes, rows, cols) a tensor).
class Layout(TypedDict):
    version: int
    n_layers: int
    n_experts: int
    top_k: int
    hidden: int
    moe_intermediate: int
    routing: str  # "softmax_topk", "topk_softmax" or "external"
    activation: str  # a name of strata_stream.pack.geometry.ACTIVATIONS
    gated: bool  # False: the records hold no gate matrix (format version 4)
    act_alpha: float
    act_limit: float
    bias_format: int
    norm_topk_prob: bool
    weight_format: int
    group_size: int
    scale_format: int
    record_bytes: int
    record_stride: int
    meta_offset: int
    meta_bytes: int
    meta_crc: int
    router_offset: int
    router_bytes: int
    router_crc: int
    checksum_offset: int
    checksum_bytes: int
    records_offset: int
    file_bytes: int
    classes: list[tuple[tuple[int, int, int], tuple[int, int, int], tuple[int, int, int]]]
    class_tensors: list[list[tuple[int, int, int, int, int, int]]]
    layer_class: list[int]

CRC32C_IMPL: str  # "sse4.2", "armv8-crc" or "table"

@overload
def read_layout(header: Buffer, where: str, file_bytes: int | None = None) -> Layout: ...
@overload
def read_layout(path: str) -> Layout: ...
def crc32c(buffer: Buffer, seed: int = 0) -> int: ...

# ---- stream.cpp: residency/slot.h and ExpertStream -----------------------------------------

ABSENT: int

class ReadClass(IntEnum):
    URGENT = ...
    PRED1 = ...
    PRED2 = ...
    PROFILE = ...

class SlotState(IntEnum):
    FREE = ...
    QUEUED = ...
    READING = ...
    COMPLETE = ...
    LIMBO = ...
    FAILED = ...

def disposing() -> int: ...
def backend_names() -> list[str]: ...
def register_backend(name: str, factory: object) -> None: ...

# Expert ids: an integer array, sequence or int (0-d or 1-d); the engine checks their range.
_Ids = npt.ArrayLike

class StreamOptions:
    arena_bytes: int
    io_threads: int
    part_bytes: int
    io_spin_us: int
    direct_io: bool
    verify_reads: bool
    io_timeout_s: float
    publish_prefetch: bool
    simulate_io: bool
    eviction: str  # "decayed_lfu" or "lru"
    def __init__(self) -> None: ...
    def validate(self) -> None: ...

class Stream:
    def __init__(self, path: str, options: StreamOptions) -> None: ...
    def close(self) -> None: ...
    @property
    def closed(self) -> bool: ...
    @property
    def n_slots(self) -> int: ...
    @property
    def layout(self) -> Layout: ...
    @property
    def direct_io(self) -> bool: ...
    @property
    def direct_note(self) -> str: ...
    @property
    def arena(self) -> npt.NDArray[np.uint8]: ...
    @property
    def slot_bytes_stride(self) -> int: ...
    def expert_bytes(self, layer: int, expert: int) -> npt.NDArray[np.uint8] | None: ...
    def fill(self) -> bool: ...
    def slots(self) -> dict[str, npt.NDArray[Any]]: ...
    def stats(self) -> dict[str, float]: ...

# ---- window.cpp: exec/window.h ---------------------------------------------------------------

class WindowOptions:
    lookahead: bool
    split_turn: bool
    max_rows: int
    decode_rows: int
    decode_batch_rows: int
    device_timeout_s: float
    two_layer_prompt: bool
    two_layer_max: int
    two_layer_decode: bool
    prompt_buf_reuse: bool
    record_routes: bool
    start_layers: int
    moce: str  # "off", "scale" or "prune"
    moce_strength: float
    moce_keep_top: int
    profile_prefetch: bool
    prefetch_backoff: bool
    def __init__(self) -> None: ...
    def validate(self) -> None: ...

class LayerStats(TypedDict):
    calls: int
    tokens: int
    hits: int
    misses: int
    bytes_read: int
    stall_seconds: float
    handshake_seconds: float
    handshake_cpu_seconds: float
    waves: int
    pred_correct: int
    pred_predicted: int
    pred_actual: int
    moce_moved_mass: float
    moce_changed: int
    settle_seconds: float

class PrefetchStats(TypedDict):
    backoff: bool
    state: str
    cap: int | None
    peak: int
    epochs: int
    cuts: int
    raises: int
    probes: int
    last_precision: float | None
    last_busy: float | None
    trials: int
    abandoned_trials: int
    deterministic: bool
    last_wall_on_s: float | None
    last_wall_off_s: float | None
    layer_caps: list[int | None]  # per layer: its cap on reads started for it (None: none)
    layer_precision: list[float | None]  # per layer: precision at its last judgement
    layer_gates: int

class Window:
    def __init__(
        self,
        stream: Stream,
        options: WindowOptions = ...,
        *,
        backend: str = "cpu",
        threads: int = 0,
    ) -> None: ...
    def moe(self, layer: int, x: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]: ...
    def moe_routed(
        self,
        layer: int,
        x: Buffer,
        dtype: str,
        ids: _Ids,
        weights: npt.ArrayLike | None,
        pred1: _Ids | None = None,
        pred2: _Ids | None = None,
        *,
        arithmetic: str = "float32",
        weights_dtype: str = "float32",
        per_entry: bool = False,
    ) -> npt.NDArray[np.float32]: ...
    def moe_routed_external(
        self,
        layer: int,
        ids: _Ids,
        pred1: _Ids | None,
        pred2: _Ids | None,
        compute: Callable[[int, int, npt.NDArray[np.uint32]], object],
    ) -> None: ...
    def moe_routed_device(
        self,
        layer: int,
        x: int,
        out: int,
        rows: int,
        ids: _Ids,
        weights: npt.ArrayLike,
        pred1: _Ids | None = None,
        pred2: _Ids | None = None,
        stream: int | None = None,
    ) -> None: ...
    @property
    def device_io_unsupported(self) -> str: ...
    @property
    def per_entry_unsupported(self) -> str: ...
    @property
    def completion_pending(self) -> bool: ...
    def arithmetic_unsupported(self, x_dtype: str, layer: int | None = None) -> str: ...
    def wants_predictions(self, layer: int, rows: int) -> tuple[bool, bool]: ...
    def pass_layer(self, layer: int) -> None: ...
    def close(self) -> None: ...
    @property
    def closed(self) -> bool: ...
    def begin_turn(self) -> None: ...
    def end_turn(self) -> None: ...
    @property
    def in_turn(self) -> bool: ...
    @property
    def next_layer(self) -> int: ...
    @property
    def backend(self) -> str: ...
    @property
    def backend_tuning(self) -> str: ...
    @property
    def scratch_bytes(self) -> int: ...
    def reset_stats(self) -> None: ...
    @property
    def settles(self) -> bool: ...
    @property
    def route_layer(self) -> int: ...  # -1: nothing routed yet (or moce off)
    def route_resident(self) -> npt.NDArray[np.bool_]: ...
    def prefetch_stats(self) -> PrefetchStats: ...
    def profile(self) -> npt.NDArray[np.uint32]: ...
    def set_profile(self, counts: npt.NDArray[np.integer[Any]]) -> None: ...
    def take_routes(self) -> npt.NDArray[np.int32]: ...  # [n, 3]: token, layer, expert
    def layer_stats(self) -> list[LayerStats]: ...

# ---- replay.cpp ------------------------------------------------------------------------------

class ReplayCounts(TypedDict):
    hits: int
    misses: int

def replay_trace(
    stream: Stream,
    steps: npt.NDArray[np.int32],
    ids: npt.NDArray[np.int32],
    pred1: npt.NDArray[np.int32] | None = None,
) -> ReplayCounts: ...

# ---- testing.cpp: the `testing` submodule (strata_stream.testing is its Python face) -------

class _Testing:
    def pending_jobs(self, stream: Stream) -> list[tuple[int, int, int, ReadClass]]: ...
    def run_job(self, stream: Stream, index: int = 0) -> bool: ...
    def inject_fault(
        self,
        stream: Stream,
        *,
        layer: int,
        expert: int,
        part: int = -1,
        kind: str = "eio",
        count: int = 1,
        errno_value: int = 5,
        delay_s: float = 0.0,
    ) -> None: ...
    def clear_faults(self, stream: Stream) -> None: ...
    def evict_one(self, stream: Stream) -> int: ...  # -1: none may go
    def check_invariants(self, stream: Stream) -> str: ...
    def raise_engine_error(self, kind: int, what: str) -> None: ...  # ErrorKind's C++ order
    # The handshake's steps, for the stream's own client.
    def request(
        self, stream: Stream, layer: int, experts: _Ids, cls: ReadClass
    ) -> tuple[int, int, int]: ...
    def wait(self, stream: Stream, layer: int, experts: _Ids) -> None: ...
    def publish(self, stream: Stream, layer: int) -> int: ...
    def enter_layer(self, stream: Stream, layer: int, experts: _Ids | None = None) -> None: ...
    def after_layer(self, stream: Stream, layer: int) -> None: ...
    def end_turn(self, stream: Stream) -> None: ...
    def plan(self, stream: Stream, layer: int, experts: _Ids) -> npt.NDArray[np.uint8]: ...
    def release_plan(self, stream: Stream) -> None: ...
    def cancel(self, stream: Stream, layer: int, expert: int) -> bool: ...
    def retire_unused_pre(self, stream: Stream, layer: int, chosen: _Ids) -> int: ...
    def release_limbo(self, stream: Stream) -> int: ...
    def victim(self, stream: Stream, speculative: bool = False) -> int: ...  # -1: none
    # The stream's maps, part split and clients.
    def smap(self, stream: Stream) -> npt.NDArray[np.uint32]: ...
    def key(self, stream: Stream, layer: int, expert: int) -> int: ...
    def where(self, stream: Stream, layer: int, expert: int) -> int: ...  # -1: nowhere
    def slot_bytes(self, stream: Stream, slot: int) -> npt.NDArray[np.uint8]: ...
    def n_parts(self, stream: Stream) -> int: ...
    def part_bytes(self, stream: Stream) -> int: ...
    def n_clients(self, stream: Stream) -> int: ...
    def clients_waiting_for_space(self, stream: Stream) -> int: ...

testing: _Testing
