"""Synthetic packs: random experts with real models' geometry, for tests, demos and benchmarks.

Every router and record comes from its own generator seeded by (seed, kind, layer[, expert]), so
a record can be regenerated alone and records can be generated in parallel in any order.
Quantized presets draw random packed words and small scales directly instead of quantizing
floats: the 16 GB Qwen3-30B-A3B preset then writes at disk speed.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import numpy as np
import numpy.typing as npt

from strata_stream.errors import ConfigError
from strata_stream.pack.geometry import Geometry
from strata_stream.pack.header import QUANT_FORMAT_BITS, WEIGHT_FORMATS, normalize_format
from strata_stream.pack.quant import QuantizedMatrix, to_scale_dtype
from strata_stream.pack.writer import ExpertMatrix, write_pack

# Standard deviation of synthetic expert weights: a typical init scale, so that x @ W.T with
# unit-variance x stays O(1) at these widths.
WEIGHT_STD = 0.02
_ROUTER, _EXPERT = 0, 1


@dataclass(frozen=True)
class Preset:
    name: str
    geometry: Geometry
    weight_format: str
    group_size: int
    scale_dtype: str
    architecture: str
    description: str


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "tiny",
            Geometry(4, 16, 4, 64, 32, "softmax_topk", True),
            "f16",
            32,
            "f16",
            "synthetic",
            "4 layers x 16 experts, for unit tests (~1 MB)",
        ),
        Preset(
            "demo",
            Geometry(16, 64, 8, 1024, 256, "softmax_topk", True),
            "q4",
            64,
            "f16",
            "synthetic",
            "16 layers x 64 experts, q4, a few hundred MB",
        ),
        Preset(
            "qwen3-30b-a3b",
            Geometry(48, 128, 8, 2048, 768, "softmax_topk", True),
            "q4",
            64,
            "f16",
            "qwen3_moe",
            "Qwen3-30B-A3B expert geometry, q4 group 64 (~16 GB), random weights",
        ),
    )
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}") from None


def preset_router(preset: Preset, seed: int, layer: int) -> npt.NDArray[np.float32]:
    """Router of one layer: standard normal / sqrt(hidden), float32 [n_experts, hidden]."""
    g = preset.geometry
    rng = np.random.default_rng((seed, _ROUTER, layer))
    scale = np.float32(1.0 / math.sqrt(g.hidden))
    router: npt.NDArray[np.float32] = rng.standard_normal((g.n_experts, g.hidden), np.float32)
    router *= scale
    return router


def preset_expert(
    preset: Preset, seed: int, layer: int, expert: int, weight_format: str, group_size: int
) -> tuple[ExpertMatrix, ExpertMatrix, ExpertMatrix]:
    """(gate, up, down) of one synthetic expert in the form write_pack takes for the format."""
    rng = np.random.default_rng((seed, _EXPERT, layer, expert))
    bits = QUANT_FORMAT_BITS.get(weight_format)
    mats: list[ExpertMatrix] = []
    for rows, cols in preset.geometry.matrix_shapes():
        if bits is None:
            mats.append(rng.standard_normal((rows, cols), np.float32) * np.float32(WEIGHT_STD))
        elif weight_format == "mxfp4":
            mats.append(_random_mxfp4(rng, rows, cols))
        else:
            mats.append(_random_quantized(rng, rows, cols, bits, group_size, preset.scale_dtype))
    return mats[0], mats[1], mats[2]


def _random_mxfp4(rng: np.random.Generator, rows: int, cols: int) -> QuantizedMatrix:
    # Uniform codes have FP4 values of mean 0 and rms sqrt(68.5 / 8); exponents one apart
    # around the scale that makes that ~WEIGHT_STD.
    rms = math.sqrt(68.5 / 8)
    centre = 127 + round(math.log2(WEIGHT_STD / rms))
    n_words = rows * cols // 8
    words = rng.bit_generator.random_raw((n_words + 1) // 2).view(np.uint32)[:n_words]
    scales = rng.integers(centre - 1, centre + 1, (rows, cols // 32), dtype=np.uint8, endpoint=True)
    return QuantizedMatrix(words.reshape(rows, cols // 8), scales, None, 4, 32, mode="mxfp4")


def _random_quantized(
    rng: np.random.Generator, rows: int, cols: int, bits: int, group_size: int, scale_dtype: str
) -> QuantizedMatrix:
    levels = 1 << bits
    # q is uniform on 0..levels-1 (random words), whose std is sqrt((levels^2 - 1) / 12); pick
    # scales so the dequantized weights have std ~WEIGHT_STD, and biases that centre them on 0.
    base = WEIGHT_STD / math.sqrt((levels * levels - 1) / 12.0)
    groups = cols // group_size
    n_words = rows * cols * bits // 32
    # Raw 64-bit draws are the cheapest random bits numpy offers (rng.bytes is several x slower).
    words = rng.bit_generator.random_raw((n_words + 1) // 2).view(np.uint32)[:n_words]
    # float32 draws: about twice as fast as float64 ones, and these are 1/group of the words.
    scales = rng.random((rows, groups), np.float32) * np.float32(0.5 * base)
    scales += np.float32(0.75 * base)
    offset = rng.standard_normal((rows, groups), np.float32) * np.float32(0.1 * WEIGHT_STD)
    biases = -scales * np.float32((levels - 1) / 2) + offset
    return QuantizedMatrix(
        weight=words.reshape(rows, n_words // rows),
        scales=to_scale_dtype(scales, scale_dtype),
        biases=to_scale_dtype(biases, scale_dtype),
        bits=bits,
        group_size=group_size,
    )


class _Prefetcher:
    """Calls a pure per-record generator ahead of the writer on a thread pool.

    numpy's generators and array arithmetic release the GIL, so generation runs in parallel
    with itself and with the writer's crc32 + write. Calls in any order other than file order
    just fall back to computing on the spot.
    """

    def __init__(
        self,
        fn: Callable[[int, int], tuple[ExpertMatrix, ExpertMatrix, ExpertMatrix]],
        n_experts: int,
        n_records: int,
    ) -> None:
        self.fn = fn
        self.n_experts = n_experts
        self.n_records = n_records
        workers = max(1, min(8, (os.cpu_count() or 2) - 1))
        self.depth = 2 * workers
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="strata-preset")
        self.futures: dict[int, Future[tuple[ExpertMatrix, ExpertMatrix, ExpertMatrix]]] = {}
        self.next_submit = 0

    def __call__(self, layer: int, expert: int) -> tuple[ExpertMatrix, ExpertMatrix, ExpertMatrix]:
        index = layer * self.n_experts + expert
        while self.next_submit < min(index + self.depth, self.n_records):
            i = self.next_submit
            self.futures[i] = self.pool.submit(self.fn, *divmod(i, self.n_experts))
            self.next_submit += 1
        fut = self.futures.pop(index, None)
        return fut.result() if fut is not None else self.fn(layer, expert)

    def __enter__(self) -> _Prefetcher:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def pack_preset(
    name: str,
    out: str | os.PathLike[str],
    weight_format: str | None = None,
    seed: int = 0,
    progress: bool = True,
    group_size: int | None = None,
) -> Path:
    """Write the synthetic preset `name` to `out`; returns the path.

    weight_format and group_size default to the preset's. The same (name, seed, format) always
    gives the same file bytes.
    """
    preset = get_preset(name)
    fmt = weight_format or preset.weight_format
    if fmt not in WEIGHT_FORMATS:
        raise ConfigError(f"weight_format must be one of {', '.join(WEIGHT_FORMATS)}, got {fmt!r}")
    gs = group_size or (32 if fmt == "mxfp4" else preset.group_size)
    sd = "e8m0" if fmt == "mxfp4" else preset.scale_dtype
    normalize_format(preset.geometry, fmt, gs, sd)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"seed must be a non-negative int, got {seed!r}")
    g = preset.geometry

    def expert(layer: int, e: int) -> tuple[ExpertMatrix, ExpertMatrix, ExpertMatrix]:
        return preset_expert(preset, seed, layer, e, fmt, gs)

    with _Prefetcher(expert, g.n_experts, g.n_records) as experts:
        return write_pack(
            out,
            g,
            lambda layer: preset_router(preset, seed, layer),
            experts,
            weight_format=fmt,
            group_size=gs,
            scale_dtype=sd,
            architecture=preset.architecture,
            source=f"synthetic preset {name} (seed {seed})",
            progress=progress,
        )
