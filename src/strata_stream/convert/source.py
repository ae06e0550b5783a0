"""Which weights a converted pack was made from, and whether a checkpoint still holds them.

A pack converted from a checkpoint records, in its JSON metadata (``model.source_weights``,
docs/pack-format.md):

- every safetensors shard's name, size, modification time and the SHA-256 of its header (the
  8-byte length and the JSON that says where every tensor is);
- the SHA-256 of the bytes read from each expert tensor while converting (they are read anyway:
  a digest costs no extra IO).

Loading checks the cheap part first: the shards' sizes, mtimes and headers. If all are as
recorded the pack is the checkpoint's. If any differs (a rebuilt or touched checkpoint, or a
pack of another model of the same geometry), the expert bytes are read again and their digests
compared: equal digests confirm the pack (remembered beside it in ``<pack>.source.json``, so the
next load is cheap again); a different digest names the tensor and the shard that changed.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import struct
import sys
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from strata_stream.convert.checkpoint import ExpertLayout, find_experts, share_layout
from strata_stream.convert.safetensors_index import SafetensorsIndex
from strata_stream.convert.share import Share
from strata_stream.errors import StrataError
from strata_stream.pack.staging import unique_temporary

DIGEST = "sha256"
# What a digest is written as before its bytes have all been read: same length as the real one,
# so the metadata's size (and the pack's layout) does not change when it is filled in.
_PLACEHOLDER = "0" * hashlib.new(DIGEST).digest_size * 2
_MAX_HEADER = 100 << 20


@dataclass(frozen=True)
class ShardSignature:
    """The cheap identity of one safetensors shard."""

    name: str
    bytes: int
    mtime_ns: int
    header_sha256: str


def shard_signature(path: Path) -> ShardSignature:
    """Size, mtime and header digest of a safetensors file (reads only its header)."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        head = f.read(8)
        digest = hashlib.new(DIGEST, head)
        if len(head) == 8:
            (n,) = struct.unpack("<Q", head)
            digest.update(f.read(min(n, _MAX_HEADER)))
    return ShardSignature(path.name, st.st_size, st.st_mtime_ns, digest.hexdigest())


def shard_signatures(model_dir: Path) -> list[ShardSignature]:
    return [shard_signature(f) for f in sorted(model_dir.glob("*.safetensors"))]


class TensorDigests:
    """One SHA-256 per expert tensor of a layout, fed in read order (`update`, the `digest`
    callback of ExpertLayout.experts_fn) and computed on a thread of its own: hashlib releases
    the GIL, so hashing overlaps the reads and the pack writer instead of adding to them. A
    bounded queue keeps at most a few tensors' bytes waiting. Use it as a context manager."""

    _QUEUED = 16

    def __init__(self, layout: ExpertLayout) -> None:
        self._digests = {name: hashlib.new(DIGEST) for name in layout.tensor_names()}
        self._queue: queue.Queue[tuple[str, Any] | None] = queue.Queue(self._QUEUED)
        self._thread = threading.Thread(target=self._run, name="strata-digest", daemon=True)
        self._thread.start()
        self._done = False

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            name, data = item
            self._digests[name].update(data)

    def update(self, name: str, data: Any) -> None:
        if name not in self._digests:
            raise KeyError(f"{name} is not an expert tensor of this layout")
        self._queue.put((name, data))

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            self._queue.put(None)
            self._thread.join()

    def hexdigests(self) -> dict[str, str]:
        """Every tensor's digest, once all the bytes fed so far are hashed."""
        self._finish()
        return {name: d.hexdigest() for name, d in self._digests.items()}

    def __enter__(self) -> TensorDigests:
        return self

    def __exit__(self, *exc: object) -> None:
        self._finish()


def placeholder_record(signatures: list[ShardSignature], layout: ExpertLayout) -> dict[str, Any]:
    """The ``source_weights`` metadata object before the experts are read: digests are written
    as placeholders of their final length (the metadata precedes the records they cover)."""
    return {
        "digest": DIGEST,
        "shards": [asdict(s) for s in signatures],
        "tensors": {name: _PLACEHOLDER for name in layout.tensor_names()},
    }


def final_record(signatures: list[ShardSignature], digests: TensorDigests) -> dict[str, Any]:
    """The ``source_weights`` object once every record was read through `digests`."""
    return {
        "digest": DIGEST,
        "shards": [asdict(s) for s in signatures],
        "tensors": digests.hexdigests(),
    }


def expert_digests(model_dir: Path, share: Share) -> tuple[dict[str, str], dict[str, str]]:
    """(tensor name -> digest of the bytes a conversion for `share` reads, tensor -> its shard
    file name), reading every expert of the checkpoint once and writing nothing."""
    with SafetensorsIndex(model_dir) as index:
        layout = share_layout(find_experts(model_dir, index), share)
        with TensorDigests(layout) as digests:
            experts = layout.experts_fn(index, digests.update)
            g = layout.geometry
            for layer in range(g.n_layers):
                for e in range(g.n_experts):
                    experts(layer, e)
            result = digests.hexdigests()
        files = {}
        for name in result:
            loc = index.tensors.get(name.format(e=0))
            files[name] = loc.file.name if loc is not None else "?"
    return result, files


def _sidecar(pack_path: Path) -> Path:
    return pack_path.with_name(pack_path.name + ".source.json")


def _confirmed(pack_path: Path, meta_crc: int) -> list[dict[str, Any]] | None:
    """The shard signatures a digest check last confirmed for this pack, if any."""
    try:
        data = json.loads(_sidecar(pack_path).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("meta_crc") != meta_crc:
        return None
    shards = data.get("shards")
    return shards if isinstance(shards, list) else None


def _confirm(pack_path: Path, meta_crc: int, now: list[dict[str, Any]]) -> None:
    side = _sidecar(pack_path)
    tmp = unique_temporary(side)
    try:
        tmp.write_text(json.dumps({"meta_crc": meta_crc, "shards": now}, indent=1))
        os.replace(tmp, side)
    except OSError:  # a read-only pack directory: the next load checks the digests again
        tmp.unlink(missing_ok=True)


def source_mismatch(
    pack_path: Path,
    model: dict[str, Any],
    meta_crc: int,
    model_dir: Path,
    share: Share,
    progress: bool = False,
) -> str | None:
    """None when the pack at `pack_path` (its metadata's ``model`` object and meta_crc) was
    made from the expert bytes `model_dir` holds now; else why not, in a phrase. `progress`:
    say so on stderr before reading the experts again (as long as a conversion's reads)."""
    record = model.get("source_weights")
    if not isinstance(record, dict) or not isinstance(record.get("tensors"), dict):
        return "it does not record which weights it was made from (an older strata-stream wrote it)"
    now = [asdict(s) for s in shard_signatures(model_dir)]
    if now == record.get("shards") or now == _confirmed(pack_path, meta_crc):
        return None
    # The cheap identity changed: compare the bytes themselves.
    if progress:
        print(f"strata-stream: the shards of {model_dir} are not those {pack_path} records: "
              "comparing their expert bytes with it", file=sys.stderr)  # fmt: skip
    try:
        digests, files = expert_digests(model_dir, share)
    except StrataError as e:
        return f"the checkpoint's experts cannot be read as the pack's were: {e}"
    recorded: dict[str, Any] = record["tensors"]
    for name, digest in recorded.items():
        if digests.get(name) != digest:
            if name not in digests:
                return f"expert tensor {name} is not in the checkpoint"
            return (
                f"expert tensor {name} (in {files[name]}) holds other bytes than the pack was "
                "made from"
            )
    extra = sorted(set(digests) - set(recorded))
    if extra:
        return f"the checkpoint has expert tensors the pack was not made from ({extra[0]}, ...)"
    _confirm(pack_path, meta_crc, now)
    return None
