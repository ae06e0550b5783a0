"""Prompt caches kept across requests and, with a directory, across restarts.

A finished request leaves the KV cache of its tokens (prompt and answer, all but the last
sampled token) in `PromptCacheStore`; a later request whose prompt starts with some of those
tokens takes a copy and reads only the rest. The store keeps:

- in memory, the most recently used caches up to `memory_bytes` (least recently used first
  out);
- with a directory, one file per cache, up to `disk_bytes` over every file of ours there
  (least recently used first out: a file's mtime is its last use).

Where the engine's arithmetic depends on how many rows a call has (torch's CPU kernels do:
a prefill chunk of 32 rows and one of 7 give the same rows' values to the last bit or not),
the store is made with `align` (the server's prefill chunk): it keeps only the part of a
prompt's cache that full chunks wrote, and serves a multiple of `align` tokens, so every
position is computed in the same chunk, of the same rows, cold or warm. A file records its
`align` and serves only a store of the same one.

A cache can serve a prompt that shares only part of its tokens when it can be trimmed (plain
KV caches: mlx-lm's `can_trim_prompt_cache`, transformers' DynamicCache of full-attention
layers); one that cannot (rotating or hybrid caches) serves only a prompt that starts with all
of its tokens. At least the prompt's last token is always read: its logits give the first
sampled token.

Files. `strata-prompt-<model>-<pack>-<prefix>.safetensors`: the model's and the pack's
fingerprints (`fingerprints`) and a hash of the token prefix. The mlx-lm engine writes mlx-lm's
own `save_prompt_cache` format, the transformers engine the DynamicCache's key and value
tensors per layer with `safetensors.torch`. Either file's metadata holds our mark, the format,
both full fingerprints, the tokens and a digest of the tensors; a file is used only when every
one of them matches (another model's or pack's file is refused with a log line and left alone,
a corrupted or truncated one is refused and, being ours, removed). Files are written through
pack/staging.py's `staged` (a private directory beside the destination, renamed onto it once
complete); the staging directories of a killed writer are swept when the store opens. A file
that does not carry our name and mark is never touched.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import struct
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from strata_stream.errors import ConfigError
from strata_stream.pack.staging import remove_leftovers, staged
from strata_stream.serve.metrics import ServerMetrics

log = logging.getLogger("strata_stream.serve")

MARK = "strata-stream prompt cache"
_VERSION = "1"
_NAME = re.compile(r"^strata-prompt-[0-9a-f]{16}-[0-9a-f]{16}-[0-9a-f]{16}\.safetensors$")
_STAGING = re.compile(r"^\.(?P<name>.+)\.[0-9a-f]{32}\.staging$")
# A safetensors header larger than this is not one of ours (a 100k-token prefix is ~1 MB).
_MAX_HEADER = 64 * 2**20


@dataclass(frozen=True)
class PromptCacheConfig:
    """memory_bytes: caches kept in memory (0: none). directory: where caches persist (None:
    memory only). disk_bytes: the bound on our files' total size there."""

    memory_bytes: int = 2**30
    directory: Path | None = None
    disk_bytes: int = 8 * 2**30

    def __post_init__(self) -> None:
        if self.memory_bytes < 0 or self.disk_bytes < 0:
            raise ConfigError("prompt cache sizes must be >= 0")


class CacheOps(Protocol):
    """What the store needs of an engine's cache object."""

    format: str

    def nbytes(self, cache: Any) -> int: ...
    def trimmable(self, cache: Any) -> bool: ...
    def storable(self, cache: Any) -> bool: ...
    def copy(self, cache: Any) -> Any: ...
    def trim_to(self, cache: Any, n_tokens: int) -> None: ...
    def length(self, cache: Any) -> int: ...
    def digest(self, cache: Any) -> str: ...
    def save(self, path: Path, cache: Any, metadata: dict[str, str]) -> None: ...
    def load(self, path: Path) -> Any: ...
    def fits(self, cache: Any) -> bool: ...


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    cache: Any
    nbytes: int


@dataclass
class _File:
    tokens: tuple[int, ...]
    path: Path
    size: int


def _hash(data: bytes, n: int = 16) -> str:
    return hashlib.blake2b(data, digest_size=32).hexdigest()[:n]


def prefix_hash(tokens: Sequence[int]) -> str:
    return hashlib.blake2b(struct.pack(f"<{len(tokens)}q", *tokens), digest_size=32).hexdigest()


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def read_metadata(path: Path) -> dict[str, str] | None:
    """A safetensors file's metadata (without reading its tensors), the mlx-lm format's
    nesting ("0.<key>") taken off; None when the file is not a readable safetensors file."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                return None
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER:
                return None
            header = json.loads(f.read(n))
    except (OSError, ValueError):
        return None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict):
        return None
    out: dict[str, str] = {}
    for k, v in meta.items():
        if isinstance(k, str) and isinstance(v, str):
            out[k[2:] if k.startswith("0.") else k] = v
    return out


class PromptCacheStore:
    """The caches of one server (used by its worker thread; metrics are read from any)."""

    def __init__(
        self,
        ops: CacheOps,
        config: PromptCacheConfig,
        metrics: ServerMetrics,
        fingerprints: Callable[[], tuple[str, str]] | None = None,
        align: int = 0,
    ) -> None:
        self._ops = ops
        self._align = align
        self._config = config
        self._metrics = metrics
        self._memory: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()
        self._memory_bytes = 0
        self._files: dict[Path, _File] = {}
        # Our files of another model or pack: counted in the bound, evicted in turn.
        self._files_other: dict[Path, int] = {}
        self._model = self._pack = ""
        self._dir = config.directory
        if self._dir is not None:
            if fingerprints is None:
                raise ConfigError("a prompt cache directory needs the model's fingerprints")
            self._model, self._pack = fingerprints()
            self._open_directory(self._dir)
        self._publish()

    # ---- lookup ------------------------------------------------------------------------------
    def fetch(self, prompt: Sequence[int]) -> tuple[Any, int]:
        """(a cache of the prompt's first n tokens, n), the longest we have; (None, 0) when
        none serves. The cache is the caller's own copy."""
        prompt = tuple(prompt)
        best_n, best_mem, best_file = 0, None, None
        for entry in self._memory.values():
            n = self._usable(entry.tokens, prompt, self._ops.trimmable(entry.cache), self._align)
            if n > best_n:
                best_n, best_mem = n, entry
        for f in self._files.values():
            n = self._usable(f.tokens, prompt, self._trimmable_file, self._align)
            if n > best_n:
                best_n, best_mem, best_file = n, None, f
        cache = None
        if best_mem is not None:
            self._memory.move_to_end(best_mem.tokens)
            cache = self._ops.copy(best_mem.cache)
        elif best_file is not None:
            cache = self._load(best_file)
            if cache is None:  # refused: try again without it
                return self.fetch(prompt)
        if cache is None:
            self._metrics.prompt_cache_misses.inc()
            return None, 0
        if self._ops.length(cache) != best_n:
            self._ops.trim_to(cache, best_n)
        self._metrics.prompt_cache_hits.inc()
        self._metrics.prompt_cache_tokens.inc(best_n)
        return cache, best_n

    # Files are written only for trimmable caches of one format (`storable`), so every file
    # of this model and pack can be trimmed.
    _trimmable_file = True

    @staticmethod
    def _usable(
        tokens: tuple[int, ...], prompt: tuple[int, ...], trimmable: bool, align: int
    ) -> int:
        """How many of the prompt's tokens a cache of `tokens` serves: never the last one,
        and a multiple of `align` when given."""
        n = min(_common(tokens, prompt), len(prompt) - 1)
        if align:
            n -= n % align
        if n == len(tokens) or (trimmable and n > 0):
            return n
        return 0

    # ---- keeping -----------------------------------------------------------------------------
    def store(self, tokens: Sequence[int], cache: Any, prompt_length: int | None = None) -> None:
        """Keeps the cache of `tokens` (the store owns it from now on); with `align`, only
        its first full chunks of the prompt (`prompt_length` tokens)."""
        tokens = tuple(tokens)
        if not tokens or not self._ops.fits(cache) or self._ops.length(cache) != len(tokens):
            return
        trimmable = self._ops.trimmable(cache)
        if self._align:
            keep = min(len(tokens), prompt_length if prompt_length is not None else len(tokens))
            keep -= keep % self._align
            if keep == 0 or (keep < len(tokens) and not trimmable):
                return
            if keep < len(tokens):
                self._ops.trim_to(cache, keep)
                tokens = tokens[:keep]
        nbytes = self._ops.nbytes(cache)
        if self._config.memory_bytes > 0 and nbytes <= self._config.memory_bytes:
            old = self._memory.pop(tokens, None)
            if old is not None:
                self._memory_bytes -= old.nbytes
            if trimmable:  # a cache of a prefix of these tokens serves nothing this one won't
                for k in [
                    k for k in self._memory if len(k) < len(tokens) and tokens[: len(k)] == k
                ]:
                    self._memory_bytes -= self._memory.pop(k).nbytes
            self._memory[tokens] = _Entry(tokens, cache, nbytes)
            self._memory_bytes += nbytes
            while self._memory_bytes > self._config.memory_bytes:
                _, gone = self._memory.popitem(last=False)
                self._memory_bytes -= gone.nbytes
        if self._dir is not None and trimmable and self._ops.storable(cache):
            self._write(tokens, cache)
        self._publish()

    # ---- files -------------------------------------------------------------------------------
    def _name(self, tokens: Sequence[int]) -> str:
        prefix = prefix_hash([self._align, *tokens])[:16]
        return f"strata-prompt-{self._model[:16]}-{self._pack[:16]}-{prefix}.safetensors"

    def _open_directory(self, d: Path) -> None:
        try:
            d.mkdir(parents=True, exist_ok=True)
            entries = list(d.iterdir())
        except OSError as e:
            raise ConfigError(f"prompt cache directory {d}: {e.strerror or e}") from None
        for entry in entries:
            m = _STAGING.match(entry.name)
            if m is not None and _NAME.match(m["name"]):
                for gone in remove_leftovers(d, m["name"]):
                    log.info("prompt cache: removed %s, left by a writer that stopped", gone)
        refused = 0
        for entry in entries:
            if not _NAME.match(entry.name) or not entry.is_file():
                continue
            meta = read_metadata(entry)
            if meta is None or meta.get("mark") != MARK:
                continue  # not ours (or unreadable): never touched
            try:
                size = entry.stat().st_size
            except OSError:  # gone meanwhile (another server's bound)
                continue
            if (meta.get("model"), meta.get("pack"), meta.get("format"), meta.get("align")) != (
                self._model,
                self._pack,
                self._ops.format,
                str(self._align),
            ):
                refused += 1
                self._files_other[entry] = size
                continue
            try:
                tokens = tuple(int(t) for t in json.loads(meta["tokens"]))
            except (KeyError, ValueError, TypeError):
                log.warning("prompt cache: refused %s: its token list is unreadable", entry)
                continue
            self._files[entry] = _File(tokens, entry, size)
        if refused:
            log.info("prompt cache: %d file(s) in %s belong to another model, pack or engine; "
                     "left alone", refused, d)  # fmt: skip

    def _load(self, f: _File) -> Any:
        meta = read_metadata(f.path)
        why = None
        if meta is None or meta.get("mark") != MARK:
            why = "not a prompt cache file of ours any more"
        elif (meta.get("model"), meta.get("pack")) != (self._model, self._pack):
            why = "it belongs to another model or pack"
        elif meta.get("prefix") != prefix_hash(f.tokens):
            why = "its tokens do not match its name"
        cache = None
        if why is None:
            try:
                cache = self._ops.load(f.path)
            except Exception as e:
                why = f"unreadable ({type(e).__name__}: {e})"
        if cache is not None and why is None:
            if self._ops.length(cache) != len(f.tokens):
                why = "its cache does not hold its tokens"
            elif not self._ops.fits(cache):
                why = "its layers do not match the model"
            elif self._ops.digest(cache) != meta.get("digest"):  # type: ignore[union-attr]
                why = "its tensors do not match their digest (corrupted)"
        if why is not None:
            log.warning("prompt cache: refused %s: %s", f.path, why)
            self._files.pop(f.path, None)
            if meta is not None and meta.get("mark") == MARK:
                with _quiet():
                    f.path.unlink()
            self._metrics.prompt_cache_refused.inc()
            self._publish()
            return None
        with _quiet():
            os.utime(f.path)  # its last use, for the LRU bound
        return cache

    def _write(self, tokens: tuple[int, ...], cache: Any) -> None:
        assert self._dir is not None
        out = self._dir / self._name(tokens)
        meta = {
            "mark": MARK,
            "version": _VERSION,
            "format": self._ops.format,
            "align": str(self._align),
            "model": self._model,
            "pack": self._pack,
            "prefix": prefix_hash(tokens),
            "tokens": json.dumps(list(tokens)),
            "digest": self._ops.digest(cache),
        }
        try:
            with staged(out) as tmp:
                self._ops.save(tmp, cache, meta)
            size = out.stat().st_size
        except Exception as e:  # a full disk or a read-only directory: memory still serves
            log.warning("prompt cache: could not write %s: %s", out, e)
            return
        self._files[out] = _File(tokens, out, size)
        # A file of a prefix of these tokens serves nothing this one won't.
        for p, f in list(self._files.items()):
            if p != out and len(f.tokens) < len(tokens) and tokens[: len(f.tokens)] == f.tokens:
                self._remove_file(p)
        self._bound_disk()

    def _remove_file(self, p: Path) -> None:
        self._files.pop(p, None)
        self._files_other.pop(p, None)
        with _quiet():
            p.unlink()

    def _bound_disk(self) -> None:
        def mtime(p: Path) -> float:
            try:
                return p.stat().st_mtime
            except OSError:
                return 0.0

        sizes = {p: f.size for p, f in self._files.items()} | self._files_other
        total = sum(sizes.values())
        for p in sorted(sizes, key=mtime):
            if total <= self._config.disk_bytes:
                break
            self._remove_file(p)
            total -= sizes[p]

    def _publish(self) -> None:
        self._metrics.prompt_cache_bytes.set(self._memory_bytes)
        self._metrics.prompt_cache_disk_bytes.set(sum(f.size for f in self._files.values()))

    @property
    def memory_bytes(self) -> int:
        return self._memory_bytes

    @property
    def files(self) -> list[Path]:
        return sorted(self._files)


class _quiet:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return exc[0] is not None and issubclass(exc[0], OSError)  # type: ignore[arg-type]


# ---- fingerprints ----------------------------------------------------------------------------
def pack_fingerprint(model: Any) -> str:
    """A digest of the model's pack (its header, metadata and every record's checksum); for a
    model whose experts are not streamed, a digest that names no pack."""
    path = getattr(model, "strata_pack_path", None)
    if path is None:
        return hashlib.blake2b(b"no pack", digest_size=32).hexdigest()
    from strata_stream.pack.reader import ExpertPack

    with ExpertPack.open(path) as p:
        h = hashlib.blake2b(digest_size=32)
        h.update(json.dumps(p.metadata, sort_keys=True, default=str).encode())
        h.update(repr(p.header).encode())
        g = p.geometry
        for layer in range(g.n_layers):
            for expert in range(g.n_experts):
                h.update(struct.pack("<I", p.checksum(layer, expert)))
        return h.hexdigest()


def weights_fingerprint(named: Sequence[tuple[str, Any, str, tuple[int, ...]]]) -> str:
    """A digest of (name, bytes, dtype, shape) for every weight, in order."""
    h = hashlib.blake2b(digest_size=32)
    for name, data, dtype, shape in named:
        h.update(f"{name}|{dtype}|{shape}|".encode())
        h.update(data)
    return h.hexdigest()
