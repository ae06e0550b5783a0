"""Write a pack file from routers and per-expert matrices (docs/pack-format.md)."""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import numpy.typing as npt
from tqdm import tqdm

from strata_stream.pack.geometry import Geometry
from strata_stream.pack.header import (
    FLOAT_FORMATS,
    MATRICES,
    NUMPY_DTYPES,
    QUANT_FORMAT_BITS,
    LayerFormat,
    MatrixFormat,
    PackHeader,
    TensorEntry,
    build_header,
    encode_metadata,
    record_crc,
)
from strata_stream.pack.quant import (
    QuantizedMatrix,
    dequantize,
    f32_to_bf16_bits,
    quantize,
    quantize_mxfp4,
    scale_values_f32,
    to_scale_dtype,
)
from strata_stream.pack.staging import remove_leftovers, staged

ExpertMatrix = npt.ArrayLike | QuantizedMatrix
# None in the gate's place (and its bias's) for gateless experts (Geometry.gated False).
ExpertFn = Callable[[int, int], Sequence[ExpertMatrix | None]]
RouterSource = Sequence[npt.ArrayLike] | Callable[[int], npt.ArrayLike]

# Records in flight between the producer (caller's experts() + filling) and the writer thread;
# three lets generation, checksum+write and the next generation overlap without much memory.
_BUFFERS = 3


def write_pack(
    path: str | os.PathLike[str],
    geometry: Geometry,
    routers: RouterSource | None,
    experts: ExpertFn,
    weight_format: str = "f32",
    group_size: int = 64,
    scale_dtype: str = "f16",
    architecture: str = "synthetic",
    source: str = "",
    progress: bool = True,
    bias_dtype: str | None = None,
    model: dict[str, Any] | None = None,
    final_model: Callable[[], dict[str, Any]] | None = None,
    layer_formats: tuple[LayerFormat, ...] = (),
) -> Path:
    """Write a pack to `path` atomically and return the path.

    routers: ``routers[l]`` or ``routers(l)``, a float array ``[n_experts, hidden]``.
    experts: ``experts(l, e) -> (gate, up, down)``, float arrays of shapes
    ``[moe_intermediate, hidden]``, ``[moe_intermediate, hidden]``, ``[hidden, moe_intermediate]``.
    For q4/q8 a matrix may be a `QuantizedMatrix` with the pack's bits and group size; its words
    are copied verbatim (scales converted only if their dtype differs from `scale_dtype`). A
    QuantizedMatrix given for a float format is dequantized. `experts` is called once per record
    in file order (layer-major), so a generator may prefetch ahead.

    With `bias_dtype` ("f32", "f16", "bf16": the experts have Linear biases, gpt-oss),
    `experts` returns six arrays: gate, up, down, then their biases ``[moe_intermediate]``,
    ``[moe_intermediate]``, ``[hidden]`` (bf16 as uint16 bit patterns, copied when the dtype
    matches). With ``geometry.routing == "external"`` the pack holds no routers: pass
    ``routers=None``. `model` is the converted checkpoint's layout (JSON metadata "model").
    `final_model()`, called once every record is written, gives the "model" object to store in
    its place: what only reading the experts tells (the digests of their source bytes); it must
    encode to the same length as `model`, since the metadata precedes the records.

    mxfp4 packs take group_size 32 and scale_dtype "e8m0"; an mxfp4 `QuantizedMatrix` is copied,
    a float array quantized by `quantize_mxfp4` (not byte-identical to MLX's quantizer).

    group_size and scale_dtype apply to quantized formats only. `layer_formats` (one
    (gate, up, down) tuple of `MatrixFormat` per layer) stores each matrix in its own format
    instead, where they differ by layer or matrix (a version 3 pack, docs/pack-format.md); each
    matrix `experts` returns is then checked against its own. The file appears at `path` only
    once it is complete (written to a temporary file in the same directory, then renamed).
    """
    if not isinstance(geometry, Geometry):
        raise TypeError(f"geometry must be a Geometry, got {type(geometry).__name__}")
    path = Path(path)
    header, meta_blob = build_header(
        geometry,
        weight_format,
        group_size,
        scale_dtype,
        architecture,
        source,
        bias_dtype,
        model,
        layer_formats,
    )
    remove_leftovers(path.parent, path.name)  # a killed writer's, of this same file
    _check_free_space(path, header.file_bytes)
    with staged(path) as tmp, open(tmp, "wb", buffering=0) as f:
        # The header goes last: it carries the router checksum, known only after writing.
        f.write(bytes(header.meta_offset))
        f.write(meta_blob)
        _pad_to(f, header.router_offset)
        router_crc = _write_routers(f, header, routers)
        _pad_to(f, header.records_offset)
        checksums = _write_records(f, header, experts, path, progress)
        if final_model is not None:
            header = _rewrite_model(f, header, meta_blob, architecture, source, final_model())
        f.seek(header.checksum_offset)
        f.write(checksums.astype("<u4").tobytes())
        f.seek(0)
        f.write(dataclasses.replace(header, router_crc=router_crc).to_bytes())
        f.seek(0, os.SEEK_END)
        if f.tell() != header.file_bytes:  # pragma: no cover - a writer bug, not user error
            raise AssertionError(f"wrote {f.tell()} bytes, expected {header.file_bytes}")
        os.fsync(f.fileno())
    return path


def _rewrite_model(
    f: BinaryIO,
    header: PackHeader,
    old_blob: bytes,
    architecture: str,
    source: str,
    model: dict[str, Any],
) -> PackHeader:
    blob = encode_metadata(header.metadata(architecture, source, model))
    if len(blob) != len(old_blob):
        raise ValueError(
            f"final_model changed the metadata's length ({len(old_blob)} -> {len(blob)} bytes)"
        )
    f.seek(header.meta_offset)
    _write_all(f, blob)
    return dataclasses.replace(header, meta_crc=zlib.crc32(blob))


def _check_free_space(path: Path, nbytes: int) -> None:
    # Fail before writing gigabytes rather than on the last record.
    try:
        free = shutil.disk_usage(path.parent).free
    except OSError:
        return
    if free < nbytes:
        raise OSError(
            errno.ENOSPC,
            f"pack needs {nbytes} bytes but only {free} are free on its filesystem",
            str(path),
        )


def _write_all(f: BinaryIO, data: bytes | bytearray | memoryview) -> None:
    # Raw (unbuffered) writes may be short; loop so no byte is silently dropped.
    view = memoryview(data).cast("B")
    while view:
        n = f.write(view)
        if n is None or n <= 0:
            raise OSError(errno.EIO, "short write", getattr(f, "name", None))
        view = view[n:]


def _pad_to(f: BinaryIO, offset: int) -> None:
    gap = offset - f.tell()
    assert gap >= 0
    if gap:
        _write_all(f, bytes(gap))


def _write_routers(f: BinaryIO, header: PackHeader, routers: RouterSource | None) -> int:
    g = header.geometry
    if not g.has_routers:
        if routers is not None:
            raise ValueError('routing "external" packs hold no routers: pass routers=None')
        return 0
    if routers is None:
        raise ValueError(f"routers are required for routing {g.routing!r}")
    if not callable(routers) and len(routers) != g.n_layers:
        raise ValueError(f"routers has {len(routers)} layers, expected n_layers {g.n_layers}")
    crc = 0
    for layer in range(g.n_layers):
        raw = routers(layer) if callable(routers) else routers[layer]
        arr = np.asarray(raw)
        if arr.dtype.kind != "f":
            raise TypeError(f"router of layer {layer}: expected a float array, got {arr.dtype}")
        expected = (g.n_experts, g.hidden)
        if arr.shape != expected:
            raise ValueError(
                f"router of layer {layer}: expected shape {expected} [n_experts, hidden], "
                f"got {arr.shape}"
            )
        data = np.ascontiguousarray(arr, dtype="<f4").data.cast("B")
        crc = zlib.crc32(data, crc)
        _write_all(f, data)
    return crc


class _RecordFiller:
    """Puts one expert's matrices into a record buffer in the pack's stored encoding (each
    matrix in its layer's format for that matrix)."""

    def __init__(self, header: PackHeader) -> None:
        self.header = header
        self.shapes = header.geometry.matrix_shapes()

    def views(self, buf: bytearray, layer: int) -> list[npt.NDArray[Any]]:
        return [_view(buf, t) for t in self.header.tensors_of(layer)]

    def fill(self, views: list[npt.NDArray[Any]], layer: int, expert: int, mats: Any) -> None:
        bias_dtype = self.header.bias_dtype
        want = 3 if bias_dtype is None else 6
        if not isinstance(mats, (tuple, list)) or len(mats) != want:
            what = "(gate, up, down)" if want == 3 else "(gate, up, down) and their 3 biases"
            count = f" of {len(mats)}" if isinstance(mats, (tuple, list)) else ""
            raise TypeError(
                f"experts({layer}, {expert}) must return {what}, got {type(mats).__name__}{count}"
            )
        formats = self.header.formats_of(layer)
        tensors = self.header.tensors_of(layer)
        gated = self.header.geometry.gated
        for m, mat in enumerate(mats[:3]):
            where = f"layer {layer} expert {expert} {MATRICES[m]}"
            if m == 0 and not gated:  # gateless experts: the record holds up and down only
                if mat is not None or (bias_dtype is not None and mats[3] is not None):
                    raise TypeError(f"{where}: the experts are gateless; pass None for the gate")
                continue
            dst = [v for v, t in zip(views, tensors, strict=True) if t.matrix == m]
            fmt = formats[m]
            if fmt.weight_format in FLOAT_FORMATS:
                self._fill_float(dst[0], mat, self.shapes[m], where, fmt)
            else:
                self._fill_quant(dst, mat, self.shapes[m], where, fmt)
            if bias_dtype is not None:
                _fill_bias(dst[-1], mats[3 + m], bias_dtype, self.shapes[m][0], f"{where} bias")

    def _fill_float(
        self,
        dst: npt.NDArray[Any],
        mat: Any,
        shape: tuple[int, int],
        where: str,
        fmt: MatrixFormat,
    ) -> None:
        if isinstance(mat, QuantizedMatrix):
            _check_shape(mat.shape, shape, where)
            arr: npt.NDArray[Any] = dequantize(mat)
        else:
            arr = _float_array(mat, where)
            _check_shape(arr.shape, shape, where)
        if fmt.weight_format == "bf16":
            dst[...] = f32_to_bf16_bits(arr)
        else:
            np.copyto(dst, arr, casting="same_kind")

    def _fill_quant(
        self,
        dst: list[npt.NDArray[Any]],
        mat: Any,
        shape: tuple[int, int],
        where: str,
        fmt: MatrixFormat,
    ) -> None:
        gs, sd, name = fmt.group_size, fmt.scale_dtype, fmt.weight_format
        bits = QUANT_FORMAT_BITS[name]
        assert sd is not None
        if name == "mxfp4":
            if isinstance(mat, QuantizedMatrix):
                if mat.mode != "mxfp4":
                    raise TypeError(f"{where}: a {mat.mode} QuantizedMatrix in an mxfp4 pack")
                mx4 = mat  # copied as it comes
                _check_shape(mx4.shape, shape, where)
            else:
                arr = _float_array(mat, where)
                _check_shape(arr.shape, shape, where)
                mx4 = quantize_mxfp4(arr)
            dst[0][...] = mx4.weight
            dst[1][...] = mx4.scales
            return
        if isinstance(mat, QuantizedMatrix):
            if mat.mode != "affine":
                raise TypeError(f"{where}: a {mat.mode} QuantizedMatrix in a {name} pack")
            if mat.bits != bits or mat.group_size != gs:
                raise ValueError(
                    f"{where}: QuantizedMatrix has {mat.bits} bits, group {mat.group_size}; "
                    f"this {name} pack needs {bits} bits, group {gs}"
                )
            _check_shape(mat.shape, shape, where)
            qm = mat
        else:
            arr = _float_array(mat, where)
            _check_shape(arr.shape, shape, where)
            qm = quantize(arr, gs, bits, sd)
        dst[0][...] = qm.weight
        assert qm.biases is not None  # affine
        for view, values in ((dst[1], qm.scales), (dst[2], qm.biases)):
            if qm.scale_dtype == sd:
                view[...] = values  # same dtype: a byte copy, as converters expect
            else:
                view[...] = to_scale_dtype(scale_values_f32(values), sd)


def _fill_bias(dst: npt.NDArray[Any], values: Any, dtype: str, rows: int, where: str) -> None:
    arr = np.asarray(values)
    if arr.shape not in ((rows,), (1, rows)):
        raise ValueError(f"{where}: expected shape ({rows},), got {arr.shape}")
    arr = arr.reshape(1, rows)
    if arr.dtype == np.uint16 or arr.dtype == dst.dtype:
        if arr.dtype != dst.dtype:  # bf16 bits into a float pack dtype
            arr = to_scale_dtype(scale_values_f32(arr), dtype)
        dst[...] = arr  # same dtype: a byte copy
    elif arr.dtype.kind == "f":
        dst[...] = to_scale_dtype(arr.astype(np.float32), dtype)
    else:
        raise TypeError(f"{where}: expected a float array (bf16 as uint16), got {arr.dtype}")


def _view(buf: bytearray, t: TensorEntry) -> npt.NDArray[Any]:
    arr = np.frombuffer(buf, dtype=NUMPY_DTYPES[t.dtype], count=t.rows * t.cols, offset=t.offset)
    return arr.reshape(t.rows, t.cols)


def _float_array(mat: Any, where: str) -> npt.NDArray[Any]:
    arr = np.asarray(mat)
    if arr.dtype.kind != "f":
        raise TypeError(f"{where}: expected a float array or QuantizedMatrix, got {arr.dtype}")
    return arr


def _check_shape(got: tuple[int, ...], expected: tuple[int, int], where: str) -> None:
    if tuple(got) != expected:
        raise ValueError(f"{where}: expected shape {expected}, got {tuple(got)}")


def _write_records(
    f: BinaryIO, header: PackHeader, experts: ExpertFn, path: Path, progress: bool
) -> npt.NDArray[np.uint32]:
    g = header.geometry
    filler = _RecordFiller(header)
    # Tensor gaps and the tail padding are never written into, so they stay zero across reuse
    # by records of one format class; a buffer is zeroed when it changes class.
    buffers = [bytearray(header.record_stride) for _ in range(_BUFFERS)]
    classes = [header.class_of(0)] * _BUFFERS
    views = [filler.views(b, 0) for b in buffers]
    checksums = np.zeros(g.n_records, dtype=np.uint32)
    pending: list[Future[None] | None] = [None] * _BUFFERS

    def flush(index: int, buf: bytearray) -> None:
        # record_crc (CRC32C) and file writes release the GIL, so this overlaps the next fill.
        checksums[index] = record_crc(memoryview(buf)[: header.record_bytes])
        _write_all(f, buf)

    bar = tqdm(total=g.n_records, unit="rec", desc=f"pack {path.name}", disable=not progress)
    # One writer thread keeps writes in file order.
    with bar, ThreadPoolExecutor(max_workers=1, thread_name_prefix="strata-pack") as pool:
        for index in range(g.n_records):
            slot = index % _BUFFERS
            previous = pending[slot]
            if previous is not None:
                previous.result()
            layer, expert = divmod(index, g.n_experts)
            if header.class_of(layer) != classes[slot]:
                buffers[slot][:] = bytes(header.record_stride)
                classes[slot] = header.class_of(layer)
                views[slot] = filler.views(buffers[slot], layer)
            filler.fill(views[slot], layer, expert, experts(layer, expert))
            pending[slot] = pool.submit(flush, index, buffers[slot])
            bar.update(1)
        for fut in pending:
            if fut is not None:
                fut.result()
    return checksums
