"""Decode tokens/s: the ceiling the expert reads set, the ceiling the computation sets, and the
range between overlapping them perfectly and not at all.

Per decoded token, every MoE layer routes top-k experts; a share (1 - hit rate) of them is
missing from the arena and read, a record stride each. So a layer misses m = (1 - hit) x top_k
records and a token layers x m, bytes = layers x m x stride. A layer waits for its misses: the
first one's whole read, a lone record's latency (doctor measures it, the IO threads' hand-offs
included), the others streaming behind it at the read rate, so
    t_io = layers x (min(1, m) x latency + max(0, m - 1) x stride / read rate)
(bytes / read rate where the latency is not known: --disk-gbps). The computation reads every
weight the token uses once: the dense weights (of an input embedding that is not also the
output head, one row) and layers x top_k expert records, which takes t_compute = those bytes /
the memory read rate (unless the caller knows the model's all-resident decode rate, compute_tps).
    IO ceiling      1 / t_io          (every read overlapped with computation, none waited for)
    compute ceiling 1 / t_compute     (every expert resident)
    range           1 / (t_io_cold + t_compute)  ..  1 / max(t_io, t_compute)
The low end is a decode that waits for each miss with nothing else to do, at the trace's hit
rate with every use counted (t_io_cold: its first uses missing too, as in a short
conversation); the high end one whose reads all overlap with computation (prefetch, or the IO
threads ahead of the device), at the hit rate with first uses left out (a long one).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from strata_stream.config import AUTO_BUFFERED_MEMORY_FRACTION, DEFAULT_IO_THREADS
from strata_stream.doctor.saved import DoctorResult
from strata_stream.units import human_bytes

# Where nothing was measured or given: a laptop NVMe SSD reading scattered MiB records, and one
# core reading memory. plan says when it uses them.
ASSUMED_DISK_GBPS = 2.0
ASSUMED_MEMORY_GBPS = 10.0


@dataclass(frozen=True)
class Rate:
    bytes_per_s: float
    source: str  # how it was obtained, for the report
    assumed: bool = False
    latency_s: float = 0.0  # a lone record's read, hand-offs included; 0: not known


def read_rate(
    pack_bytes: int,
    memory: int,
    record_stride: int,
    disk_gbps: float | None,
    doctor: DoctorResult | None,
) -> Rate:
    """How fast the engine's misses read: --disk-gbps where given; else doctor's reading nearest
    the record size at the default IO threads, in the mode the engine would read the pack in:
    direct for a pack larger than a quarter of the memory, else buffered through the page cache,
    which keeps the pack after its first read (doctor's cached reading). Nothing measured: an
    assumed disk rate, or the memory's for a pack that stays cached."""
    if disk_gbps is not None:
        return Rate(disk_gbps * 1e9, "given (--disk-gbps)")
    direct = pack_bytes > memory * AUTO_BUFFERED_MEMORY_FRACTION
    modes = ("direct", "buffered") if direct else ("cached",)
    if doctor is not None:
        for mode in modes:
            r = doctor.disk_gbps(mode, record_stride, DEFAULT_IO_THREADS)
            if r is not None:
                when = time.strftime("%Y-%m-%d %H:%M", time.localtime(doctor.measured_at))
                why = (
                    "" if direct else "the pack fits a quarter of the memory, so it stays cached; "
                )
                return Rate(
                    r.gbps * 1e9,
                    f"{why}doctor, {when}, {doctor.path}: {r.mode} reads "
                    f"of {human_bytes(r.record_bytes)} records, {r.threads} threads, "
                    f"{r.latency_s * 1e3:.3f} ms a lone record",
                    latency_s=r.latency_s,
                )
    if not direct:
        mem = memory_rate(doctor)
        return Rate(
            mem.bytes_per_s,
            "page cache: the pack fits a quarter of the memory, so the "
            f"engine reads it buffered and it stays cached ({mem.source})",
            mem.assumed,
        )
    return Rate(
        ASSUMED_DISK_GBPS * 1e9,
        f"assumed {ASSUMED_DISK_GBPS:g} GB/s (run `strata-stream "
        "doctor` on the pack's disk, or give --disk-gbps)",
        True,
    )


def memory_rate(doctor: DoctorResult | None) -> Rate:
    if doctor is not None and doctor.memory_read_gbps > 0:
        return Rate(doctor.memory_read_gbps * 1e9, "memory read rate measured by doctor")
    return Rate(
        ASSUMED_MEMORY_GBPS * 1e9,
        f"memory read rate assumed {ASSUMED_MEMORY_GBPS:g} GB/s (run `strata-stream doctor`)",
        True,
    )


@dataclass(frozen=True)
class DecodeSpeed:
    misses_per_token: float  # at the hit rate (first uses left out)
    read_bytes_per_token: float
    compute_bytes_per_token: int  # 0 where compute_tps was given
    io_ceiling: float  # tokens/s; inf when nothing is read
    compute_ceiling: float
    low: float
    high: float
    # The same at the cold hit rate (every use counted), which the low end uses.
    misses_per_token_cold: float
    io_ceiling_cold: float


def _t_io(hit_rate: float, moe_layers: int, top_k: int, stride: int, read: Rate) -> float:
    per_layer = (1.0 - hit_rate) * top_k
    if read.latency_s <= 0:
        return moe_layers * per_layer * stride / read.bytes_per_s
    # A layer with misses waits for its first record's whole read (hand-offs included), the
    # others stream behind it; a share per_layer < 1 of the layers misses at all.
    per = min(1.0, per_layer) * read.latency_s
    per += max(0.0, per_layer - 1.0) * stride / read.bytes_per_s
    return moe_layers * per


def decode_speed(
    hit_rate: float,
    moe_layers: int,
    top_k: int,
    record_bytes: int,
    record_stride: int,
    dense_bytes: int,
    read: Rate,
    memory: Rate,
    compute_tps: float | None = None,
    cold_hit_rate: float | None = None,
) -> DecodeSpeed:
    """The ceilings and range at `hit_rate`; with `cold_hit_rate` (a lower one: the trace's
    every use counted) the low end is taken at it, so the range spans both."""
    cold = hit_rate if cold_hit_rate is None else min(hit_rate, cold_hit_rate)
    t_io = _t_io(hit_rate, moe_layers, top_k, record_stride, read)
    t_io_cold = _t_io(cold, moe_layers, top_k, record_stride, read)
    compute_bytes = 0
    if compute_tps is not None:
        t_compute = 1.0 / compute_tps
    else:
        compute_bytes = dense_bytes + moe_layers * top_k * record_bytes
        t_compute = compute_bytes / memory.bytes_per_s
    misses = (1.0 - hit_rate) * top_k * moe_layers
    return DecodeSpeed(
        misses,
        misses * record_stride,
        compute_bytes,
        1.0 / t_io if t_io > 0 else math.inf,
        1.0 / t_compute,
        1.0 / (t_io_cold + t_compute),
        1.0 / max(t_io, t_compute),
        (1.0 - cold) * top_k * moe_layers,
        1.0 / t_io_cold if t_io_cold > 0 else math.inf,
    )


__all__ = [
    "ASSUMED_DISK_GBPS",
    "ASSUMED_MEMORY_GBPS",
    "DecodeSpeed",
    "Rate",
    "decode_speed",
    "memory_rate",
    "read_rate",
]
