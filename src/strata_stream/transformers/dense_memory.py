"""Where the transformers front-end's dense weights live in host memory, and what of them the
arena budget counts.

transformers maps a safetensors checkpoint's tensors from its files where the stored dtype is
the one asked for: each dense weight is then a range of file pages, loaded on first touch and
dropped by the kernel under memory pressure. Under a memory limit the arena takes what the
dense weights leave, so pages the kernel dropped would be read again on every token that needs
them. `settle` sorts the weights by how a decoding step reads them:

- read whole (attention, norms, routers, shared experts, the output head, an embedding tied to
  it): copied out of the file mapping into anonymous memory (same dtype, shape and strides, so
  the values and every result computed from them are bitwise what they were), which the kernel
  cannot drop without swap. The file pages the copy read are paged out as it goes, so the
  container's charge holds the copy alone; the arena is sized after, from that charge.
- read by rows (the weight of an `nn.Embedding` no other module holds: the input embedding
  where the output head is a tensor of its own): left mapped, advised MADV_RANDOM so that a
  row's page fault reads that row's pages rather than the disk's read-ahead around them. A
  step reads one row per token, so it is counted as the rows of one prompt chunk (`rows`),
  not whole: its other pages are page cache the kernel may drop, and the arena gets the rest.

The copies are made only where they fit: inside a container whose memory limit leaves less
than they need (with a chunk of page cache and the budget's margin), the kernel would kill the
process during the copy, with no message. There nothing is copied, the weights stay mapped and
count whole, and `held_back` says how many bytes: the loader then refuses an automatically sized
arena in one line (an explicit arena_bytes streams anyway, the dense pages read again as the
kernel drops them).

Tensors already in anonymous memory (converted on load to another dtype, or built in memory),
and tensor subclasses (a quantizer's) or strided views, stay as they are and are counted
whole; tensors on a GPU are not host memory and are not counted. Where there is no
/proc/self/maps (not Linux) nothing is moved and every host tensor is counted whole.
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from strata_stream import container_memory
from strata_stream.arena_budget import MARGIN_MIN

PROC_MAPS = "/proc/self/maps"  # module-level: tests point it elsewhere
MADV_RANDOM = 1
MADV_WILLNEED = 3
MADV_HUGEPAGE = 14
MADV_PAGEOUT = 21  # Linux 5.4; elsewhere madvise refuses it and the pages stay cached
_HUGE = 2 << 20  # a transparent huge page: a copy smaller than one gets no such hint
_CHUNK = 64 << 20  # bytes copied between page-outs: the page cache the copy holds at a time
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclass(frozen=True)
class DenseMemory:
    """The host memory of a model's dense weights after `settle`, in bytes (each tensor once).

    resident: in anonymous memory (charged to the process and its container), the copies
    `settle` made (`copied`) among it; mapped: left mapped from the checkpoint's files (read
    by rows, or `held_back`); counted: what the arena budget counts, resident plus the rows of
    one prompt chunk of the embedding left mapped and the held-back weights whole; pending: the
    part of counted no container charge holds yet; held_back: weights a step reads whole that
    were left mapped because their copies did not fit the container's memory."""

    resident: int = 0
    mapped: int = 0
    counted: int = 0
    copied: int = 0
    held_back: int = 0

    @property
    def pending(self) -> int:
        return self.counted - self.resident

    def as_dict(self) -> dict[str, int]:
        return {
            "dense_bytes": self.counted,
            "dense_resident_bytes": self.resident,
            "dense_mapped_bytes": self.mapped,
            "dense_copied_bytes": self.copied,
            "dense_held_back_bytes": self.held_back,
        }


@dataclass
class _Group:
    """One tensor's bytes and every (module, kind, name) slot holding it (tied weights)."""

    tensor: torch.Tensor
    holders: list[tuple[torch.nn.Module, str, str]]

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


class _Maps:
    """The process's memory mappings: which address ranges are pages of a file on disk."""

    def __init__(self, text: str) -> None:
        self.starts: list[int] = []
        self.rows: list[tuple[int, int, bool]] = []  # (start, end, file-backed)
        for line in text.splitlines():
            parts = line.split(maxsplit=5)
            if len(parts) < 5:
                continue
            lo, _, hi = parts[0].partition("-")
            path = parts[5].strip() if len(parts) > 5 else ""
            self.starts.append(int(lo, 16))
            self.rows.append((int(lo, 16), int(hi, 16), _on_disk(path, parts[4])))

    def file_backed(self, address: int) -> bool:
        i = bisect.bisect_right(self.starts, address) - 1
        return i >= 0 and self.rows[i][0] <= address < self.rows[i][1] and self.rows[i][2]


def _on_disk(path: str, inode: str) -> bool:
    """A mapping of a file on disk, whose clean pages the kernel drops and reads again; not
    anonymous memory, a special mapping ([heap]), shared memory (/dev/shm, memfd) or a deleted
    file."""
    if inode == "0" or not path.startswith("/") or path.endswith("(deleted)"):
        return False
    if path.startswith(("/dev/", "/memfd:", "/SYSV")):
        return False
    return os.path.isfile(path)


def _maps() -> _Maps | None:
    try:
        with open(PROC_MAPS) as f:
            return _Maps(f.read())
    except OSError:
        return None


def _madvise(address: int, length: int, advice: int, inward: bool) -> None:
    """A hint over the pages of [address, address + length): those wholly inside it (inward:
    a page-out must not touch a neighbour's pages) or every page it touches. Errors are
    ignored: the hint only changes what stays cached, never what the memory holds."""
    if inward:
        lo = -(-address // _PAGE) * _PAGE
        hi = (address + length) // _PAGE * _PAGE
    else:
        lo = address // _PAGE * _PAGE
        hi = -(-(address + length) // _PAGE) * _PAGE
    if hi <= lo:
        return
    madvise = _libc_madvise()
    if madvise is not None:
        madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), ctypes.c_int(advice))


@functools.cache
def _libc_madvise() -> Any:
    """libc's madvise, or None where there is none to call."""
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


def _groups(model: Any) -> Iterator[_Group]:
    """The model's host tensors (parameters and buffers), each once with every slot holding it:
    tied weights are one Parameter in several modules, or one storage range in several."""
    found: dict[tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype], _Group] = {}
    for module in model.modules():
        for kind in ("_parameters", "_buffers"):
            for name, t in getattr(module, kind).items():
                if t is None or t.device.type != "cpu" or t.numel() == 0:
                    continue
                key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
                group = found.setdefault(key, _Group(t, []))
                group.holders.append((module, kind, name))
    yield from found.values()


def _read_by_rows(group: _Group) -> bool:
    """A step reads rows of it, never the whole: the weight of embedding modules alone."""
    return group.tensor.dim() == 2 and all(
        isinstance(module, torch.nn.Embedding) and kind == "_parameters" and name == "weight"
        for module, kind, name in group.holders
    )


def _movable(t: torch.Tensor) -> bool:
    """A plain contiguous tensor, which a copy of the same shape, dtype and strides replaces
    exactly; a tensor subclass (a quantizer's) or a strided view stays as it is."""
    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.is_contiguous()


def _resident_copy(t: torch.Tensor) -> torch.Tensor:
    """`t` (contiguous) copied into anonymous memory with its dtype and shape, the file pages it
    was read from paged out a chunk at a time."""
    new = torch.empty(tuple(t.shape), dtype=t.dtype, device="cpu")
    size = t.element_size()
    if t.numel() * size >= 2 * _HUGE:
        # Huge pages where the kernel allows them (THP "madvise"), asked before the copy first
        # touches the memory: the page cache maps a checkpoint in large folios, and a copy in
        # 4 KB pages costs the matrix-vector products more TLB misses than the mapping did.
        _madvise(new.data_ptr(), t.numel() * size, MADV_HUGEPAGE, inward=True)
    flat_src, flat_dst = t.detach().reshape(-1), new.view(-1)
    step = max(1, _CHUNK // size)
    for at in range(0, flat_src.numel(), step):
        n = min(step, flat_src.numel() - at)
        address = t.data_ptr() + at * size
        _madvise(address, n * size, MADV_WILLNEED, inward=False)
        with torch.no_grad():
            flat_dst[at : at + n].copy_(flat_src[at : at + n])
        _madvise(address, n * size, MADV_PAGEOUT, inward=True)
    return new


def _replace(group: _Group, new: torch.Tensor) -> None:
    """Every slot holding the group's tensor now holds `new` (a Parameter keeps its object, so
    tied modules still share it)."""
    done: set[int] = set()
    for module, kind, name in group.holders:
        held = getattr(module, kind)[name]
        if kind == "_parameters":
            if id(held) not in done:
                held.data = new
                done.add(id(held))
        else:
            getattr(module, kind)[name] = new


def _copy_room() -> int | None:
    """Bytes the copies may take: what the container's limit leaves (container_memory: its
    charge less the page cache the kernel can drop) less one chunk of page cache the copy holds
    at a time and the budget's margin; None outside a container."""
    bound = container_memory.binding()
    return None if bound is None else bound[1] - _CHUNK - MARGIN_MIN


def settle(model: Any, rows: int) -> DenseMemory:
    """Sorts the model's host tensors as the module docstring says and returns their bytes:
    file-backed tensors a step reads whole are copied into anonymous memory where the copies
    fit (else left mapped, held back, counted whole), file-backed ones it reads by rows stay
    mapped and count `rows` rows (a prompt chunk's); anonymous ones count whole."""
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    maps = _maps()
    resident = mapped = counted = 0
    to_copy: list[_Group] = []
    for group in _groups(model):
        t, n = group.tensor, group.nbytes
        if maps is None or not _movable(t) or not maps.file_backed(t.data_ptr()):
            resident += n
            counted += n
        elif _read_by_rows(group):
            mapped += n
            row = t.stride(0) * t.element_size()
            counted += min(n, rows * row)
            _madvise(t.data_ptr(), n, MADV_RANDOM, inward=False)
            _madvise(t.data_ptr(), n, MADV_PAGEOUT, inward=True)
        else:
            to_copy.append(group)
    wanted = sum(g.nbytes for g in to_copy)
    room = _copy_room() if to_copy else None
    if room is not None and wanted > room:
        return DenseMemory(resident=resident, mapped=mapped + wanted, counted=counted + wanted,
                           held_back=wanted)  # fmt: skip
    for group in to_copy:
        _replace(group, _resident_copy(group.tensor))
    return DenseMemory(resident=resident + wanted, mapped=mapped, counted=counted + wanted,
                       copied=wanted)  # fmt: skip


__all__ = ["DenseMemory", "settle"]
