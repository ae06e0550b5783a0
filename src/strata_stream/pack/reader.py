"""Read a pack file: validated header, routers, individual expert records, checksum scan."""

from __future__ import annotations

import operator
import os
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import numpy.typing as npt
from tqdm import tqdm

from strata_stream.errors import PackError
from strata_stream.pack.geometry import Geometry
from strata_stream.pack.header import (
    FLOAT_FORMATS,
    NUMPY_DTYPES,
    QUANT_FORMAT_BITS,
    LayerFormat,
    PackHeader,
    TensorEntry,
    read_header,
    record_crc,
)
from strata_stream.pack.quant import QuantizedMatrix, bf16_bits_to_f32, dequantize

F32Array = npt.NDArray[np.float32]
StoredMatrix = npt.NDArray[Any] | QuantizedMatrix

# Bytes of routers read per step of the router checksum, to keep verify's memory flat.
_ROUTER_CHUNK = 64 << 20


class ExpertPack:
    """An open pack file. Reads are positional (pread), so one ExpertPack is thread-safe.

    Use `ExpertPack.open(path)`; close it (or use it as a context manager) when done.
    """

    def __init__(self, path: Path, fd: int, header: PackHeader, metadata: dict[str, Any]):
        self.path = path
        self.header = header
        self.metadata = metadata
        self._fd: int | None = fd
        self._checksums = np.frombuffer(
            self._pread(header.checksum_offset, header.checksum_bytes, "checksum table"),
            dtype="<u4",
        )

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> ExpertPack:
        """Open and validate a pack (header, metadata, size); raises PackError naming the field."""
        p = Path(path)
        f = open(p, "rb", buffering=0)  # noqa: SIM115 - ownership passes to the ExpertPack
        try:
            header, metadata = read_header(f, p)
            fd = os.dup(f.fileno())
        finally:
            f.close()
        try:
            return cls(p, fd, header, metadata)
        except BaseException:
            os.close(fd)
            raise

    # -- lifetime ---------------------------------------------------------------------------

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    @property
    def closed(self) -> bool:
        return self._fd is None

    def __enter__(self) -> ExpertPack:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __del__(self) -> None:
        # A forgotten close must not leak the descriptor; getattr: __init__ may not have run.
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)

    def __repr__(self) -> str:
        g = self.geometry
        return (
            f"ExpertPack({str(self.path)!r}, {g.n_layers}x{g.n_experts} experts, "
            f"{self.weight_format}{', closed' if self.closed else ''})"
        )

    # -- layout -----------------------------------------------------------------------------

    @property
    def geometry(self) -> Geometry:
        return self.header.geometry

    @property
    def weight_format(self) -> str:
        return self.header.weight_format

    @property
    def group_size(self) -> int:
        """Quantization group size; 0 for float formats."""
        return self.header.group_size

    @property
    def scale_dtype(self) -> str | None:
        """Dtype of scales and biases ("f32", "f16", "bf16"; "e8m0" for mxfp4's exponents);
        None for float formats."""
        return self.header.scale_dtype

    @property
    def record_bytes(self) -> int:
        return self.header.record_bytes

    @property
    def record_stride(self) -> int:
        return self.header.record_stride

    @property
    def records_offset(self) -> int:
        return self.header.records_offset

    @property
    def file_bytes(self) -> int:
        return self.header.file_bytes

    @property
    def n_records(self) -> int:
        return self.header.n_records

    @property
    def tensors(self) -> tuple[TensorEntry, ...]:
        """Layer 0's tensor table (every layer's, unless the formats differ by layer)."""
        return self.header.tensors

    @property
    def mixed(self) -> bool:
        """Whether the experts' formats differ by layer or matrix (a version 3 pack)."""
        return self.header.mixed

    def tensors_of(self, layer: int) -> tuple[TensorEntry, ...]:
        """The tensor table of `layer`'s records."""
        return self.header.tensors_of(self._check(layer)[0])

    def formats_of(self, layer: int) -> LayerFormat:
        """How `layer`'s gate, up and down are stored."""
        return self.header.formats_of(self._check(layer)[0])

    def _check(self, layer: int, expert: int | None = None) -> tuple[int, int]:
        g = self.geometry
        layer = operator.index(layer)
        if not 0 <= layer < g.n_layers:
            raise IndexError(f"layer {layer} out of range 0..{g.n_layers - 1}")
        if expert is None:
            return layer, 0
        expert = operator.index(expert)
        if not 0 <= expert < g.n_experts:
            raise IndexError(f"expert {expert} out of range 0..{g.n_experts - 1}")
        return layer, expert

    def record_offset(self, layer: int, expert: int) -> int:
        """File offset of record (layer, expert); a multiple of PAGE (16 KiB)."""
        return self.header.record_offset(*self._check(layer, expert))

    def checksum(self, layer: int, expert: int) -> int:
        """The CRC32C the checksum table holds for record (layer, expert)."""
        layer, expert = self._check(layer, expert)
        return int(self._checksums[layer * self.geometry.n_experts + expert])

    # -- reads ------------------------------------------------------------------------------

    def _pread(self, offset: int, n: int, what: str) -> bytes:
        fd = self._fd
        if fd is None:
            raise ValueError(f"pack {self.path} is closed")
        data = os.pread(fd, n, offset)
        if len(data) != n:
            raise PackError(
                f"pack {self.path}: short read of {what} at offset {offset}: got {len(data)} "
                f"of {n} bytes (file truncated while open?)"
            )
        return data

    def router_weights(self, layer: int) -> F32Array:
        """Router of `layer` as float32 ``[n_experts, hidden]``."""
        layer, _ = self._check(layer)
        g = self.geometry
        if not g.has_routers:
            raise PackError(
                f"pack {self.path}: routing is external (the model routes itself), so the pack "
                "holds no routers"
            )
        n = g.n_experts * g.hidden * 4
        data = self._pread(self.header.router_offset + layer * n, n, f"router of layer {layer}")
        return np.frombuffer(data, dtype="<f4").astype(np.float32).reshape(g.n_experts, g.hidden)

    def read_record(self, layer: int, expert: int) -> bytes:
        """The checksummed payload (record_bytes, no padding) of record (layer, expert)."""
        off = self.record_offset(layer, expert)
        return self._pread(off, self.record_bytes, f"record (layer {layer}, expert {expert})")

    def stored_weights(
        self, layer: int, expert: int
    ) -> tuple[StoredMatrix, StoredMatrix, StoredMatrix]:
        """(gate, up, down) as stored: float arrays (bf16 as uint16 bits) or QuantizedMatrix.
        Gateless experts (geometry.gated False) have a float32 gate of no rows."""
        record = self.read_record(layer, expert)
        tensors = self.tensors_of(layer)
        out: list[StoredMatrix] = []
        for m, fmt in enumerate(self.formats_of(layer)):
            if m == 0 and not self.geometry.gated:
                out.append(np.zeros((0, self.geometry.hidden), np.float32))
                continue
            # Its weight, then scales (quantized) and biases (affine) in role order.
            w, *rest = [_tensor(record, t) for t in tensors if t.matrix == m and t.role != 3]
            name = fmt.weight_format
            if name in FLOAT_FORMATS:
                out.append(w)
                continue
            mode = "mxfp4" if name == "mxfp4" else "affine"
            biases = rest[1] if len(rest) > 1 else None
            out.append(
                QuantizedMatrix(w, rest[0], biases, QUANT_FORMAT_BITS[name], fmt.group_size, mode)
            )
        return out[0], out[1], out[2]

    @property
    def bias_dtype(self) -> str | None:
        """Dtype of the experts' Linear biases (gpt-oss), None when they have none."""
        return self.header.bias_dtype

    def expert_biases(self, layer: int, expert: int) -> tuple[F32Array, F32Array, F32Array]:
        """(gate, up, down) Linear biases of one expert as float32; zeros without biases."""
        g = self.geometry
        if self.bias_dtype is None:
            inter, hidden = g.moe_intermediate, g.hidden
            return (np.zeros(inter, np.float32), np.zeros(inter, np.float32),
                    np.zeros(hidden, np.float32))  # fmt: skip
        record = self.read_record(layer, expert)
        b = [_tensor(record, t)[0] for t in self.tensors_of(layer) if t.role == 3]
        f = [bf16_bits_to_f32(v) if self.bias_dtype == "bf16" else v.astype(np.float32) for v in b]
        if not g.gated:  # gateless: no gate bias
            f.insert(0, np.zeros(0, np.float32))
        return f[0], f[1], f[2]

    def expert_weights(self, layer: int, expert: int) -> tuple[F32Array, F32Array, F32Array]:
        """(gate, up, down) of one expert as float32, dequantized; shapes as in write_pack."""
        formats = self.formats_of(layer)
        stored = self.stored_weights(layer, expert)
        # A gateless gate is already float32 (no rows); the rest widen from their formats.
        gate, up, down = (
            _to_f32(m, "f32" if i == 0 and not self.geometry.gated else f.weight_format)
            for i, (m, f) in enumerate(zip(stored, formats, strict=True))
        )
        return gate, up, down

    # -- integrity --------------------------------------------------------------------------

    def verify(
        self,
        progress: bool = True,
        on_record: Callable[[int, int], None] | None = None,
        workers: int | None = None,
    ) -> int:
        """Check the router checksum and every record's CRC32C; returns the number of records.

        Raises PackError naming the first bad record (in file order). `on_record(layer, expert)`
        is called after each good record. Reads run on `workers` threads (pread and the
        CRC release the GIL) so an SSD's queue depth is used.
        """
        self._verify_routers()
        g = self.geometry
        n_workers = workers or min(8, 2 * (os.cpu_count() or 1))
        bar = tqdm(
            total=g.n_records, unit="rec", desc=f"verify {self.path.name}", disable=not progress
        )
        with bar, ThreadPoolExecutor(n_workers, thread_name_prefix="strata-verify") as pool:
            results: Iterator[int] = pool.map(self._record_crc, range(g.n_records))
            for index, actual in enumerate(results):
                layer, expert = divmod(index, g.n_experts)
                expected = int(self._checksums[index])
                if actual != expected:
                    raise PackError(
                        f"pack {self.path}: record (layer {layer}, expert {expert}) at offset "
                        f"{self.header.record_offset(layer, expert)} fails its checksum: "
                        f"expected crc32c {expected:#010x}, actual {actual:#010x}"
                    )
                if on_record is not None:
                    on_record(layer, expert)
                bar.update(1)
        return g.n_records

    def _record_crc(self, index: int) -> int:
        layer, expert = divmod(index, self.geometry.n_experts)
        return record_crc(self.read_record(layer, expert))

    def _verify_routers(self) -> None:
        h = self.header
        crc = 0
        for start in range(0, h.router_bytes, _ROUTER_CHUNK):
            n = min(_ROUTER_CHUNK, h.router_bytes - start)
            crc = zlib.crc32(self._pread(h.router_offset + start, n, "routers"), crc)
        if crc != h.router_crc:
            raise PackError(
                f"pack {self.path}: routers at offset {h.router_offset} fail their checksum: "
                f"expected crc32 {h.router_crc:#010x} (header router_crc), actual {crc:#010x}"
            )


def _to_f32(m: StoredMatrix, weight_format: str) -> F32Array:
    if isinstance(m, QuantizedMatrix):
        return dequantize(m)
    if weight_format == "bf16":
        return bf16_bits_to_f32(m)
    return m.astype(np.float32)


def _tensor(record: bytes, t: TensorEntry) -> npt.NDArray[Any]:
    count = t.rows * t.cols
    arr = np.frombuffer(record, dtype=NUMPY_DTYPES[t.dtype], count=count, offset=t.offset)
    # Native byte order so callers (and mlx) get ordinary arrays.
    return arr.astype(arr.dtype.newbyteorder("="), copy=False).reshape(t.rows, t.cols)
