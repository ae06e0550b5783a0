"""Where every tensor of a safetensors checkpoint lives, from the headers alone.

A safetensors file is an 8-byte little-endian header length, a JSON header (per tensor: dtype,
shape, data_offsets [begin, end) relative to the end of the header), then the data. Parsing the
header ourselves lets the converter read one expert of a stacked ``[E, ...]`` tensor with one
pread of its contiguous byte range: ``safe_open(framework="numpy")`` cannot give bfloat16 and
``mx.load`` evaluates whole tensors, and either would hold far more than one expert in memory.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import numpy as np
import numpy.typing as npt

from strata_stream.errors import PackError

# safetensors dtype -> (numpy dtype of the raw elements, bytes per element). BF16 travels as its
# uint16 bit pattern, as everywhere in the pack code.
_DTYPES: dict[str, tuple[str, int]] = {
    "F32": ("<f4", 4),
    "F16": ("<f2", 2),
    "BF16": ("<u2", 2),
    "U32": ("<u4", 4),
    "U8": ("u1", 1),
    "I32": ("<i4", 4),
    "I64": ("<i8", 8),
    "F64": ("<f8", 8),
}
# A header larger than this is not a safetensors file we should trust.
_MAX_HEADER = 100 << 20


@dataclass(frozen=True)
class TensorLocation:
    file: Path
    dtype: str  # safetensors name: "BF16", "U32", ...
    shape: tuple[int, ...]
    offset: int  # absolute file offset of the first byte
    nbytes: int

    @property
    def numpy_dtype(self) -> str:
        return _DTYPES[self.dtype][0]


class SafetensorsIndex:
    """Every tensor of the ``*.safetensors`` files of a directory, with positional reads."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.tensors: dict[str, TensorLocation] = {}
        self._fds: dict[Path, int] = {}
        files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            raise PackError(f"{self.directory}: no .safetensors files")
        try:
            for f in files:
                self._index(f)
        except BaseException:
            self.close()
            raise

    def _index(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        self._fds[path] = fd
        size = os.fstat(fd).st_size
        head = os.pread(fd, 8, 0)
        if len(head) != 8:
            raise PackError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (hlen,) = struct.unpack("<Q", head)
        if hlen > min(_MAX_HEADER, size - 8):
            raise PackError(f"{path}: safetensors header length {hlen} is impossible")
        try:
            header = json.loads(os.pread(fd, hlen, 8))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise PackError(f"{path}: safetensors header is not JSON: {e}") from None
        base = 8 + hlen
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            # Unknown dtypes (fp8, ...) are fine as long as nobody asks for them.
            elem = _DTYPES[dtype][1] if dtype in _DTYPES else 1
            count = int(np.prod(shape)) if shape else 1
            if end - begin != count * elem or base + end > size:
                raise PackError(
                    f"{path}: tensor {name} has data_offsets {begin}..{end}, which do not fit "
                    f"{dtype} {list(shape)} in a {size}-byte file"
                )
            self.tensors[name] = TensorLocation(path, dtype, shape, base + begin, end - begin)

    def close(self) -> None:
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def __enter__(self) -> SafetensorsIndex:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def _pread(self, loc: TensorLocation, offset: int, n: int, what: str) -> bytes:
        data = os.pread(self._fds[loc.file], n, offset)
        if len(data) != n:
            raise PackError(f"{loc.file}: short read of {what} ({len(data)} of {n} bytes)")
        return data

    def read(self, name: str) -> npt.NDArray[np.generic]:
        """A whole (small) tensor: routers, biases of one expert."""
        loc = self.tensors[name]
        raw = self._pread(loc, loc.offset, loc.nbytes, name)
        return np.frombuffer(raw, dtype=loc.numpy_dtype).reshape(loc.shape)

    def read_expert(self, name: str, expert: int) -> npt.NDArray[np.generic]:
        """Expert `expert` of a stacked ``[E, ...]`` tensor: one contiguous pread."""
        loc = self.tensors[name]
        n_experts = loc.shape[0]
        if not 0 <= expert < n_experts:
            raise IndexError(f"{name}: expert {expert} out of range [0, {n_experts})")
        per = loc.nbytes // n_experts
        raw = self._pread(loc, loc.offset + expert * per, per, f"{name}[{expert}]")
        return np.frombuffer(raw, dtype=loc.numpy_dtype).reshape(loc.shape[1:])

    def read_expert_rows(
        self, name: str, expert: int, begin: int, end: int
    ) -> npt.NDArray[np.generic]:
        """Rows [begin, end) of expert `expert` of a stacked ``[E, rows, ...]`` tensor: one
        contiguous pread of just those rows (a tensor-parallel share of gate or up)."""
        loc = self.tensors[name]
        n_experts, n_rows = loc.shape[0], loc.shape[1]
        if not 0 <= expert < n_experts:
            raise IndexError(f"{name}: expert {expert} out of range [0, {n_experts})")
        if not 0 <= begin < end <= n_rows:
            raise IndexError(f"{name}: rows [{begin}, {end}) out of range [0, {n_rows})")
        per = loc.nbytes // n_experts
        row = per // n_rows
        raw = self._pread(
            loc, loc.offset + expert * per + begin * row, (end - begin) * row,
            f"{name}[{expert}, {begin}:{end}]",
        )  # fmt: skip
        return np.frombuffer(raw, dtype=loc.numpy_dtype).reshape((end - begin, *loc.shape[2:]))
