"""The fixed 4096-byte pack header, its tensor table and JSON metadata (docs/pack-format.md).

The layout of a pack is a pure function of (geometry, weight format, group size, scale dtype,
metadata length); `PackHeader` computes it for the writer. Reading a header is the engine's: one
parser (csrc/engine/pack/pack_file.cpp, `_core.read_layout`) refuses any header whose stored
fields differ from the canonical layout, for the engine and for `read_header` alike.
"""

from __future__ import annotations

import functools
import json
import os
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, BinaryIO

from strata_stream.errors import ConfigError, PackError
from strata_stream.pack.geometry import ACTIVATIONS, ROUTINGS, Geometry

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from strata_stream._core import Layout

MAGIC = b"STRATAPK"
# Version 2: record checksums are CRC32C (version 1 used zlib's CRC-32 for them); expert
# biases (role "bias"), the activation and its constants, "external" routing (no routers) and
# the model metadata of converted checkpoints (docs/pack-format.md).
VERSION = 2
# Version 3: experts whose format differs by layer or by matrix, as mlx-lm's quantization
# predicates make them (granitemoe's 8-bit down projections, muse_spark's unquantized first and
# last layers): up to MAX_CLASSES format classes, each a format per matrix, and each layer's
# class. A pack whose experts share one format is written as version 2, as before.
MIXED_VERSION = 3
# Version 4: experts that compute something versions 2 and 3 cannot say, an activation they do
# not know (geometry.ACTIVATIONS beyond swiglu and swiglu_oai) or no gate matrix (the layout
# flag at LAYOUT_FLAGS_OFFSET; records hold up and down). Its header is version 2's (n_classes
# 0) or version 3's (format classes) besides. A pack that needs none of it keeps its version.
FEATURE_VERSION = 4
LAYOUT_FLAGS_OFFSET = 3680
FLAG_GATELESS = 1
HEADER_BYTES = 4096
META_OFFSET = HEADER_BYTES
# The page of the pack: Apple's SSD page, and O_DIRECT-safe on Linux. Sections and records start
# on it, so one expert is one aligned read, split into parts of whole pages (the IO threads'
# StreamConfig.part_bytes). The one place Python says it.
PAGE = 16384
# Tensors inside a record start on this boundary so every tensor is aligned for SIMD/GPU loads.
TENSOR_ALIGN = 256

# q4/q8: MLX affine; mxfp4: OCP microscaling FP4 as MLX stores it (codes packed like q4, one
# E8M0 scale per 32, no biases).
WEIGHT_FORMATS = ("f32", "f16", "bf16", "q4", "q8", "mxfp4")
# "e8m0" (a u8 power-of-two exponent) is mxfp4's, and mxfp4 has only it.
SCALE_FORMATS = ("f32", "f16", "bf16", "e8m0")
FLOAT_FORMATS = ("f32", "f16", "bf16")
QUANT_FORMAT_BITS = {"q4": 4, "q8": 8, "mxfp4": 4}
GROUP_SIZES = (32, 64, 128)
MATRICES = ("gate", "up", "down")
# "biases" are the affine quantization offsets; "bias" is a Linear layer's own bias (gpt-oss).
ROLES = ("weight", "scales", "biases", "bias")
# Header field bias_format: 0 = no expert biases, else 1 + index into BIAS_FORMATS.
BIAS_FORMATS = FLOAT_FORMATS
# The little-endian numpy dtype a stored tensor reads as (bf16 as its uint16 bit patterns);
# from it, the bytes per stored element; and the dtype name the JSON metadata uses for it.
NUMPY_DTYPES = {"f32": "<f4", "f16": "<f2", "bf16": "<u2", "u32": "<u4", "e8m0": "u1"}
_ELEM_BYTES = {name: int(code[-1]) for name, code in NUMPY_DTYPES.items()}  # "<f4": 4 bytes
_JSON_DTYPES = {
    "f32": "float32", "f16": "float16", "bf16": "bfloat16", "u32": "uint32", "e8m0": "uint8",
}  # fmt: skip

# magic, 12 x u32 (version .. scale_format), 10 x u64 (record_bytes .. file_bytes),
# n_tensors, meta_crc: 144 bytes, then the tensor table.
_FIXED = struct.Struct("<8s12I10Q2I")
_FIXED_FIELDS = (
    "magic", "version", "header_bytes", "n_layers", "n_experts", "top_k", "hidden",
    "moe_intermediate", "routing", "norm_topk_prob", "weight_format", "group_size",
    "scale_format", "record_bytes", "record_stride", "meta_offset", "meta_bytes",
    "router_offset", "router_bytes", "checksum_offset", "checksum_bytes", "records_offset",
    "file_bytes", "n_tensors", "meta_crc",
)  # fmt: skip
# What the writer's PackHeader derives and the engine's parser also reports: they must agree.
_DERIVED_FIELDS = (
    "version", "record_bytes", "record_stride", "meta_offset", "router_offset", "router_bytes",
    "checksum_offset", "checksum_bytes", "records_offset", "file_bytes",
)  # fmt: skip
_TENSOR = struct.Struct("<IIQQII")
_TABLE_OFFSET = _FIXED.size
ROUTER_CRC_OFFSET = 4088
HEADER_CRC_OFFSET = 4092
_U32 = struct.Struct("<I")
# Version 2's model block: activation (u32), act_alpha (f32), act_limit (f32), bias_format (u32).
MODEL_BLOCK_OFFSET = 1024
_MODEL_BLOCK = struct.Struct("<IffI")
MAX_TENSORS = (MODEL_BLOCK_OFFSET - 144) // 32
# Version 3's format block: n_classes (u32), then per class and matrix (gate, up, down) its
# weight_format, group_size and scale_format (u32 each); then each pack layer's class, a nibble
# per layer (layer l in byte LAYER_CLASS_OFFSET + l // 2, the low nibble for even l).
FORMATS_OFFSET = 1040
MAX_CLASSES = 16
_CLASS_MATRIX = struct.Struct("<III")
LAYER_CLASS_OFFSET = 1632
assert _TABLE_OFFSET == 144 and _TENSOR.size == 32 and len(_FIXED_FIELDS) == 25
assert FORMATS_OFFSET + 4 + MAX_CLASSES * 3 * _CLASS_MATRIX.size <= LAYER_CLASS_OFFSET
assert LAYER_CLASS_OFFSET + 4096 // 2 <= LAYOUT_FLAGS_OFFSET  # every layer the engine allows
assert LAYOUT_FLAGS_OFFSET + 4 <= ROUTER_CRC_OFFSET


@functools.cache
def _engine() -> ModuleType:
    # Imported at the first header read or record checksum, not with this module: building a
    # header (the writer's PackHeader) works where the extension failed to build; reading a
    # header and checksumming records cannot, and say why.
    try:
        from strata_stream import _core
    except ImportError as e:  # pragma: no cover - a broken install
        raise ImportError(
            "strata_stream._core is not built: pack headers are parsed and record checksums "
            f"(CRC32C) computed by the engine's code ({e})"
        ) from e
    return _core


def _crc32c_impl() -> Callable[[Buffer, int], int]:
    crc32c: Callable[[Buffer, int], int] = _engine().crc32c
    return crc32c


def record_crc(data: Buffer, seed: int = 0) -> int:
    """CRC32C of a record payload (any contiguous buffer), continuing from `seed`.

    The engine's own implementation (`_core.crc32c`: SSE4.2 / ARMv8 CRC instructions, a table
    otherwise), so the writer, the reader and the engine cannot disagree. Releases the GIL for
    large buffers.
    """
    return _crc32c_impl()(data, seed)


def align_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a record: where it sits and what it holds."""

    matrix: int  # index into MATRICES
    role: int  # index into ROLES
    offset: int  # inside the record, a multiple of TENSOR_ALIGN
    nbytes: int
    rows: int
    cols: int  # in stored elements (u32 words for packed q4/q8/mxfp4)
    dtype: str  # a key of NUMPY_DTYPES; implied by the header, not stored

    @property
    def name(self) -> str:
        return f"{MATRICES[self.matrix]}.{ROLES[self.role]}"

    def to_json(self) -> dict[str, Any]:
        return {
            "matrix": MATRICES[self.matrix],
            "role": ROLES[self.role],
            "offset": self.offset,
            "nbytes": self.nbytes,
            "dtype": _JSON_DTYPES[self.dtype],
            "shape": [self.rows, self.cols],
        }


# The widths a matrix's groups run along (its input width): gate and up read hidden, down reads
# moe_intermediate; a format for every matrix must divide both.
GATE_UP_WIDTHS = ("hidden",)
DOWN_WIDTHS = ("moe_intermediate",)
ALL_WIDTHS = ("hidden", "moe_intermediate")


def normalize_format(
    geometry: Geometry,
    weight_format: str,
    group_size: int,
    scale_dtype: str | None,
    widths: tuple[str, ...] = ALL_WIDTHS,
) -> tuple[int, str | None]:
    """Check a weight format against a geometry; returns the (group_size, scale_dtype) to store.

    Float formats have no groups or scales, so they store group_size 0 and scale_dtype None
    whatever the caller passed.
    """
    if weight_format not in WEIGHT_FORMATS:
        raise ConfigError(
            f"weight_format must be one of {', '.join(WEIGHT_FORMATS)}, got {weight_format!r}"
        )
    if weight_format in FLOAT_FORMATS:
        return 0, None
    if weight_format == "mxfp4":
        if group_size != 32 or scale_dtype not in (None, "e8m0"):
            raise ConfigError(
                f"mxfp4 has groups of 32 and e8m0 scales, got group_size {group_size} and "
                f"scale_dtype {scale_dtype!r}"
            )
        group_size, scale_dtype = 32, "e8m0"
    elif scale_dtype == "e8m0":
        raise ConfigError(f"scale_dtype e8m0 is mxfp4's; {weight_format} needs f32, f16 or bf16")
    if group_size not in GROUP_SIZES:
        raise ConfigError(f"group_size must be 32, 64 or 128 for {weight_format}, got {group_size}")
    if scale_dtype not in SCALE_FORMATS:
        raise ConfigError(
            f"scale_dtype must be one of {', '.join(SCALE_FORMATS)} for {weight_format}, "
            f"got {scale_dtype!r}"
        )
    for name in widths:
        value = getattr(geometry, name)
        if value % group_size:
            raise ConfigError(
                f"Geometry.{name} {value} is not a multiple of group_size {group_size}, "
                f"which {weight_format} needs"
            )
    return group_size, scale_dtype


@dataclass(frozen=True)
class MatrixFormat:
    """How one matrix of a record is stored: a weight format, its group size and scale dtype
    (0 and None for float formats)."""

    weight_format: str
    group_size: int = 0
    scale_dtype: str | None = None

    def normalized(
        self, geometry: Geometry, widths: tuple[str, ...] = ALL_WIDTHS
    ) -> MatrixFormat:
        gs, sd = normalize_format(
            geometry, self.weight_format, self.group_size, self.scale_dtype, widths
        )
        return MatrixFormat(self.weight_format, gs, sd)

    def describe(self) -> str:
        if self.weight_format in FLOAT_FORMATS:
            return self.weight_format
        return f"{self.weight_format} g{self.group_size} {self.scale_dtype} scales"


# A layer's formats, gate, up, down.
LayerFormat = tuple[MatrixFormat, MatrixFormat, MatrixFormat]


def record_layout(
    geometry: Geometry,
    weight_format: str,
    group_size: int,
    scale_dtype: str | None,
    bias_dtype: str | None = None,
) -> tuple[tuple[TensorEntry, ...], int]:
    """`layer_record_layout` for a record whose three matrices share one format."""
    one = MatrixFormat(weight_format, group_size, scale_dtype)
    return layer_record_layout(geometry, (one, one, one), bias_dtype)


def layer_record_layout(
    geometry: Geometry, formats: LayerFormat, bias_dtype: str | None = None
) -> tuple[tuple[TensorEntry, ...], int]:
    """Tensor table and payload size of one record, for an already normalized format.

    Per matrix (gate, up, down; up and down for gateless experts): weight, then scales and
    biases (q4/q8; mxfp4 has scales only), then the expert's Linear bias ``[1, rows]`` in
    `bias_dtype` when the model has one (gpt-oss).
    This is the one statement in Python of which tensors a weight format stores, in which dtype
    and shape: the writer fills, the reader checks and slices, and the converter checks a
    checkpoint's expert tensors against it (convert/checkpoint.py). The engine's parser, which
    the reader uses, says it once more (canonical_tensors in csrc/engine/pack/pack_file.cpp);
    parse_header refuses a header on which the two disagree, and tests/test_pack.py's property
    test holds them equal for every header the writer makes.
    """
    entries: list[TensorEntry] = []
    offset = 0

    def add(matrix: int, role: int, rows: int, cols: int, dtype: str) -> None:
        nonlocal offset
        offset = align_up(offset, TENSOR_ALIGN)
        nbytes = rows * cols * _ELEM_BYTES[dtype]
        entries.append(TensorEntry(matrix, role, offset, nbytes, rows, cols, dtype))
        offset += nbytes

    for m, (rows, cols) in enumerate(geometry.matrix_shapes()):
        if m == 0 and not geometry.gated:
            continue
        weight_format, group_size, scale_dtype = (
            formats[m].weight_format,
            formats[m].group_size,
            formats[m].scale_dtype,
        )
        if weight_format in FLOAT_FORMATS:
            add(m, 0, rows, cols, weight_format)
        else:
            assert scale_dtype is not None
            bits = QUANT_FORMAT_BITS[weight_format]
            add(m, 0, rows, cols * bits // 32, "u32")
            add(m, 1, rows, cols // group_size, scale_dtype)
            if weight_format != "mxfp4":
                add(m, 2, rows, cols // group_size, scale_dtype)
        if bias_dtype is not None:
            add(m, 3, 1, rows, bias_dtype)
    # record_bytes is the end of the last tensor: the checksum covers no trailing padding.
    return tuple(entries), offset


@dataclass(frozen=True)
class PackHeader:
    """Everything in the fixed header. Offsets and sizes are derived, never chosen freely."""

    geometry: Geometry
    weight_format: str
    group_size: int
    scale_dtype: str | None
    meta_bytes: int
    meta_crc: int = 0
    router_crc: int = 0
    bias_dtype: str | None = None  # dtype of the experts' Linear biases; None: no biases
    # Each pack layer's formats (gate, up, down) when they are not all the pack format
    # (version 3); empty: every matrix of every layer in weight_format. Normalized in
    # __post_init__: empty again when they turn out uniform, and then the pack format is
    # theirs; otherwise weight_format/group_size/scale_dtype are class 0's gate.
    layer_formats: tuple[LayerFormat, ...] = ()
    tensors: tuple[TensorEntry, ...] = field(init=False)  # class 0's (every layer's, uniform)
    # The distinct layer formats in order of first use, each pack layer's index into them
    # (empty for a uniform pack: every layer is class 0), and each class's tensor table.
    classes: tuple[LayerFormat, ...] = field(init=False)
    layer_class: tuple[int, ...] = field(init=False)
    class_tensors: tuple[tuple[TensorEntry, ...], ...] = field(init=False)
    record_bytes: int = field(init=False)
    record_stride: int = field(init=False)
    router_offset: int = field(init=False)
    router_bytes: int = field(init=False)
    checksum_offset: int = field(init=False)
    checksum_bytes: int = field(init=False)
    records_offset: int = field(init=False)
    file_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        g = self.geometry
        per_layer = tuple(
            (
                lf[0].normalized(g, GATE_UP_WIDTHS),
                lf[1].normalized(g, GATE_UP_WIDTHS),
                lf[2].normalized(g, DOWN_WIDTHS),
            )
            for lf in self.layer_formats
        )
        if per_layer and len(per_layer) != g.n_layers:
            raise ConfigError(
                f"layer_formats has {len(per_layer)} entries for {g.n_layers} pack layers"
            )
        classes = tuple(dict.fromkeys(per_layer))
        if len(classes) > MAX_CLASSES:
            raise ConfigError(
                f"the experts come in {len(classes)} formats by layer and matrix; a pack holds "
                f"at most {MAX_CLASSES}"
            )
        if classes:  # the pack format is the first layer's gate's
            first = classes[0][0]
            object.__setattr__(self, "weight_format", first.weight_format)
            object.__setattr__(self, "group_size", first.group_size)
            object.__setattr__(self, "scale_dtype", first.scale_dtype)
        # With classes the pack format is the first layer's gate: only its own width applies.
        widths = GATE_UP_WIDTHS if classes else ALL_WIDTHS
        gs, sd = normalize_format(g, self.weight_format, self.group_size, self.scale_dtype, widths)
        if self.bias_dtype is not None and self.bias_dtype not in BIAS_FORMATS:
            raise ConfigError(
                f"bias_dtype must be one of {', '.join(BIAS_FORMATS)} or None, "
                f"got {self.bias_dtype!r}"
            )
        one = MatrixFormat(self.weight_format, gs, sd)
        if not classes or classes == ((one, one, one),):
            classes, per_layer = ((one, one, one),), ()
        layer_class = tuple(classes.index(lf) for lf in per_layer)
        layouts = [layer_record_layout(g, lf, self.bias_dtype) for lf in classes]
        class_tensors = tuple(t for t, _ in layouts)
        # Every record takes the largest class's payload; a smaller one is zero after its end.
        record_bytes = max(n for _, n in layouts)
        tensors = class_tensors[0]
        router_offset = align_up(META_OFFSET + self.meta_bytes, PAGE)
        router_bytes = g.n_records * g.hidden * 4 if g.has_routers else 0
        checksum_offset = align_up(router_offset + router_bytes, PAGE)
        checksum_bytes = g.n_records * 4
        records_offset = align_up(checksum_offset + checksum_bytes, PAGE)
        record_stride = align_up(record_bytes, PAGE)
        derived = {
            "group_size": gs,
            "scale_dtype": sd,
            "layer_formats": per_layer,
            "classes": classes,
            "layer_class": layer_class,
            "class_tensors": class_tensors,
            "tensors": tensors,
            "record_bytes": record_bytes,
            "record_stride": record_stride,
            "router_offset": router_offset,
            "router_bytes": router_bytes,
            "checksum_offset": checksum_offset,
            "checksum_bytes": checksum_bytes,
            "records_offset": records_offset,
            "file_bytes": records_offset + g.n_records * record_stride,
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    @property
    def meta_offset(self) -> int:
        return META_OFFSET

    @property
    def mixed(self) -> bool:
        """Whether the experts' formats differ by layer or matrix (a version 3 pack)."""
        return bool(self.layer_formats)

    @property
    def version(self) -> int:
        if self.geometry.extended:
            return FEATURE_VERSION
        return MIXED_VERSION if self.mixed else VERSION

    def class_of(self, layer: int) -> int:
        """The format class of pack layer `layer`."""
        return self.layer_class[layer] if self.layer_class else 0

    def tensors_of(self, layer: int) -> tuple[TensorEntry, ...]:
        """The tensor table of pack layer `layer`'s records."""
        return self.class_tensors[self.class_of(layer)]

    def formats_of(self, layer: int) -> LayerFormat:
        return self.classes[self.class_of(layer)]

    @property
    def n_records(self) -> int:
        return self.geometry.n_records

    def record_offset(self, layer: int, expert: int) -> int:
        index = layer * self.geometry.n_experts + expert
        return self.records_offset + index * self.record_stride

    def to_bytes(self) -> bytes:
        g = self.geometry
        values = {
            "magic": MAGIC,
            "version": self.version,
            "header_bytes": HEADER_BYTES,
            "n_layers": g.n_layers,
            "n_experts": g.n_experts,
            "top_k": g.top_k,
            "hidden": g.hidden,
            "moe_intermediate": g.moe_intermediate,
            "routing": ROUTINGS.index(g.routing),
            "norm_topk_prob": int(g.norm_topk_prob),
            "weight_format": WEIGHT_FORMATS.index(self.weight_format),
            "group_size": self.group_size,
            "scale_format": SCALE_FORMATS.index(self.scale_dtype) if self.scale_dtype else 0,
            "record_bytes": self.record_bytes,
            "record_stride": self.record_stride,
            "meta_offset": self.meta_offset,
            "meta_bytes": self.meta_bytes,
            "router_offset": self.router_offset,
            "router_bytes": self.router_bytes,
            "checksum_offset": self.checksum_offset,
            "checksum_bytes": self.checksum_bytes,
            "records_offset": self.records_offset,
            "file_bytes": self.file_bytes,
            "n_tensors": len(self.tensors),
            "meta_crc": self.meta_crc,
        }
        buf = bytearray(HEADER_BYTES)
        _FIXED.pack_into(buf, 0, *(values[name] for name in _FIXED_FIELDS))
        for i, t in enumerate(self.tensors):
            at = _TABLE_OFFSET + i * _TENSOR.size
            _TENSOR.pack_into(buf, at, t.matrix, t.role, t.offset, t.nbytes, t.rows, t.cols)
        _MODEL_BLOCK.pack_into(
            buf,
            MODEL_BLOCK_OFFSET,
            ACTIVATIONS.index(g.activation),
            g.act_alpha,
            g.act_limit,
            0 if self.bias_dtype is None else 1 + BIAS_FORMATS.index(self.bias_dtype),
        )
        if self.mixed:
            _U32.pack_into(buf, FORMATS_OFFSET, len(self.classes))
            for c, lf in enumerate(self.classes):
                for m, f in enumerate(lf):
                    at = FORMATS_OFFSET + 4 + (c * 3 + m) * _CLASS_MATRIX.size
                    _CLASS_MATRIX.pack_into(buf, at, *_format_codes(f))
            for layer, c in enumerate(self.layer_class):
                buf[LAYER_CLASS_OFFSET + layer // 2] |= c << (4 * (layer % 2))
        if not g.gated:
            _U32.pack_into(buf, LAYOUT_FLAGS_OFFSET, FLAG_GATELESS)
        _U32.pack_into(buf, ROUTER_CRC_OFFSET, self.router_crc)
        _U32.pack_into(buf, HEADER_CRC_OFFSET, zlib.crc32(buf[:HEADER_CRC_OFFSET]))
        return bytes(buf)

    def metadata(
        self, architecture: str, source: str, model: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """The JSON metadata object for this header (docs/pack-format.md, "JSON metadata").

        `model` (converted checkpoints): which decoder layer each pack layer is, and how the
        model lays out its MoE blocks; free-form beyond the keys docs/pack-format.md names.
        """
        meta: dict[str, Any] = {
            "format": "strata-pack",
            "version": self.version,
            "architecture": architecture,
            "geometry": self.geometry.to_dict(),
            "weight_format": self.weight_format,
            "group_size": self.group_size,
            "scale_dtype": self.scale_dtype,
            "record_bytes": self.record_bytes,
            "record_stride": self.record_stride,
            "offsets": {
                "router": self.router_offset,
                "checksums": self.checksum_offset,
                "records": self.records_offset,
            },
            "record_layout": [t.to_json() for t in self.tensors],
            "expert_bias": self.bias_dtype,
            "source": source,
            "model": model,
        }
        if self.mixed:
            meta["format_classes"] = [
                {MATRICES[m]: _format_json(f) for m, f in enumerate(lf)} for lf in self.classes
            ]
            meta["layer_class"] = list(self.layer_class)
        return meta


def _format_codes(f: MatrixFormat) -> tuple[int, int, int]:
    scale = SCALE_FORMATS.index(f.scale_dtype) if f.scale_dtype else 0
    return WEIGHT_FORMATS.index(f.weight_format), f.group_size, scale


def _format_json(f: MatrixFormat) -> dict[str, Any]:
    return {
        "weight_format": f.weight_format,
        "group_size": f.group_size,
        "scale_dtype": f.scale_dtype,
    }


def encode_metadata(meta: dict[str, Any]) -> bytes:
    return json.dumps(meta, indent=1).encode("utf-8")


def build_header(
    geometry: Geometry,
    weight_format: str,
    group_size: int,
    scale_dtype: str | None,
    architecture: str,
    source: str,
    bias_dtype: str | None = None,
    model: dict[str, Any] | None = None,
    layer_formats: tuple[LayerFormat, ...] = (),
) -> tuple[PackHeader, bytes]:
    """Header and metadata bytes for a new pack (router_crc still 0); `layer_formats` as
    PackHeader's."""
    # The JSON records the router offset, which depends on the JSON's own length; iterate to
    # the fixed point (one or two rounds: only the digits of a few offsets can change).
    meta_bytes = 0
    for _ in range(8):
        header = PackHeader(
            geometry,
            weight_format,
            group_size,
            scale_dtype,
            meta_bytes,
            bias_dtype=bias_dtype,
            layer_formats=layer_formats,
        )
        blob = encode_metadata(header.metadata(architecture, source, model))
        if len(blob) == meta_bytes:
            break
        meta_bytes = len(blob)
    else:  # pragma: no cover - would need offsets whose length oscillates
        raise AssertionError("metadata length did not converge")
    header = PackHeader(
        geometry,
        weight_format,
        group_size,
        scale_dtype,
        meta_bytes,
        zlib.crc32(blob),
        bias_dtype=bias_dtype,
        layer_formats=layer_formats,
    )
    return header, blob


def parse_header(buf: bytes, where: str, file_bytes: int | None = None) -> PackHeader:
    """Decode and validate header bytes with the engine's parser (`_core.read_layout`); `where`
    begins every error ("pack X"), and `file_bytes`, the size of the file they came from, must
    be the header's (None: the header alone)."""
    fields: Layout = _engine().read_layout(buf, where, file_bytes)
    return _header_of(fields, where)


def _matrix_format(codes: tuple[int, int, int]) -> MatrixFormat:
    fmt, group, scale = codes
    name = WEIGHT_FORMATS[fmt]
    return MatrixFormat(name, group, None if name in FLOAT_FORMATS else SCALE_FORMATS[scale])


def _header_of(fields: Layout, where: str) -> PackHeader:
    """The writer's PackHeader for what the engine's parser read, which must lay the pack out
    exactly as the parser found it (tests/test_pack.py's property test holds the two equal)."""
    classes = [
        (_matrix_format(g), _matrix_format(u), _matrix_format(d)) for g, u, d in fields["classes"]
    ]
    pack_format = classes[0][0]
    bias_format = fields["bias_format"]
    try:
        geometry = Geometry.from_dict(dict(fields))
        header = PackHeader(
            geometry,
            pack_format.weight_format,
            pack_format.group_size,
            pack_format.scale_dtype,
            fields["meta_bytes"],
            fields["meta_crc"],
            fields["router_crc"],
            bias_dtype=None if bias_format == 0 else BIAS_FORMATS[bias_format - 1],
            layer_formats=tuple(classes[c] for c in fields["layer_class"]),
        )
    except ConfigError as e:  # pragma: no cover - the parser refuses every such header first
        raise PackError(f"{where}: bad header: {e}") from None
    tables = [
        [(t.matrix, t.role, t.offset, t.nbytes, t.rows, t.cols) for t in table]
        for table in header.class_tensors
    ]
    checks: list[tuple[str, Any, Any]] = [
        (name, fields[name], getattr(header, name))  # type: ignore[literal-required]
        for name in _DERIVED_FIELDS
    ]
    checks.append(("class_tensors", fields["class_tensors"], tables))
    for name, engine, writer in checks:
        if engine != writer:  # pragma: no cover - a bug in one of the two
            raise PackError(
                f"{where}: the engine's parser and the writer's layout disagree on {name} "
                f"({engine} vs {writer}): a strata-stream bug, please report it"
            )
    return header


def _first_difference(got: Any, expected: Any, path: str) -> str | None:
    """Dotted path and values of the first place `got` differs from `expected`, or None."""
    if isinstance(expected, dict):
        if not isinstance(got, dict):
            return f"field {path} is {type(got).__name__}, expected an object"
        for key, value in expected.items():
            sub = f"{path}.{key}" if path else key
            if key not in got:
                return f"field {sub} is missing"
            diff = _first_difference(got[key], value, sub)
            if diff:
                return diff
        return None
    if isinstance(expected, list):
        if not isinstance(got, list) or len(got) != len(expected):
            return f"field {path} {json.dumps(got)} vs {json.dumps(expected)}"
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            diff = _first_difference(g, e, f"{path}[{i}]")
            if diff:
                return diff
        return None
    # type() too: JSON true must not pass for header 1, nor 1.0 for 1.
    if type(got) is not type(expected) or got != expected:
        return f"field {path} {json.dumps(got)} vs {json.dumps(expected)}"
    return None


def check_metadata(blob: bytes, header: PackHeader, where: str) -> dict[str, Any]:
    """Parse the JSON metadata and check it repeats the header exactly."""
    crc = zlib.crc32(blob)
    if crc != header.meta_crc:
        raise PackError(
            f"{where}: meta_crc mismatch (header says {header.meta_crc:#010x}, "
            f"metadata bytes give {crc:#010x})"
        )
    try:
        meta = json.loads(blob.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PackError(f"{where}: JSON metadata is not valid UTF-8 JSON: {e}") from None
    if not isinstance(meta, dict):
        raise PackError(f"{where}: JSON metadata is {type(meta).__name__}, expected an object")
    for key in ("architecture", "source"):
        if not isinstance(meta.get(key), str):
            raise PackError(f"{where}: JSON metadata field {key} must be a string")
    model = meta.get("model")
    if model is not None and not isinstance(model, dict):
        raise PackError(f"{where}: JSON metadata field model must be an object or null")
    expected = header.metadata(meta["architecture"], meta["source"], model)
    diff = _first_difference(meta, expected, "")
    if diff:
        raise PackError(f"{where}: JSON metadata disagrees with header: {diff} (json vs header)")
    return meta


def read_header(f: BinaryIO, path: Path) -> tuple[PackHeader, dict[str, Any]]:
    """Read and fully validate the header and metadata of an open pack file."""
    where = f"pack {path}"
    size = os.fstat(f.fileno()).st_size
    f.seek(0)
    header = parse_header(f.read(HEADER_BYTES), where, size)
    f.seek(header.meta_offset)
    blob = f.read(header.meta_bytes)
    return header, check_metadata(blob, header, where)
