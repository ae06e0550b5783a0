"""The pack a model loads with: found in the cache (converted on first use), or named by the user.

- Without a pack path, a model's pack lives in ``cache_dir()/packs`` under a name derived from
  the model's path, config and shard sizes (`default_pack_path`). It is used only if it was
  made from the weights the checkpoint holds now (convert/source.py); otherwise it is converted
  again. Using an up-to-date entry writes nothing, so a read-only cache serves it. A lock on
  the entry (``fcntl.flock``) makes a second process that loads the same model wait for the
  first one's conversion and reuse it, rather than convert it twice.
- A pack the user names (``--pack``, ``pack_path=``) is converted into if it does not exist;
  if it exists and was not made from the checkpoint's weights it is refused, naming the file
  and the tensor that differs, or the model it was made from where that is another one.

Staging directories that a killed conversion left behind are removed by the next one, once no
process holds their lock (pack/staging.py): a live conversion's, in another container or on
another host sharing the cache, is left alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from strata_stream.convert import convert
from strata_stream.convert.checkpoint import converted_activation
from strata_stream.convert.share import WHOLE, Share
from strata_stream.convert.source import source_mismatch
from strata_stream.errors import ConfigError, PackError
from strata_stream.pack.reader import ExpertPack
from strata_stream.pack.staging import remove_leftovers
from strata_stream.paths import cache_dir


def default_pack_path(model_path: Path, share: Share = WHOLE) -> Path:
    """Where `load` keeps the pack of a model it converted: the cache directory, under a name
    derived from the model's path, config and weight files, ending in the share's suffix for
    one rank of a distributed model (convert/share.py). The name only finds the entry: whether
    its pack still matches the weights is checked on every load (convert/source.py)."""
    h = hashlib.sha256(str(model_path.resolve()).encode())
    config = model_path / "config.json"
    if config.exists():
        h.update(config.read_bytes())
    for f in sorted(model_path.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    name = f"{model_path.name}-{h.hexdigest()[:16]}{share.suffix()}.strpk"
    return cache_dir() / "packs" / name


def stale_reason(
    pack_path: Path, model_path: Path, share: Share = WHOLE, progress: bool = False
) -> str | None:
    """None when the pack at `pack_path` was made from the experts `model_path` holds now;
    else why not (an unreadable pack included). `progress`: say when the digests are read."""
    try:
        with ExpertPack.open(pack_path) as pack:
            model = pack.metadata.get("model")
            crc = pack.header.meta_crc
            geometry = pack.geometry
    except PackError as e:
        return str(e)
    if not isinstance(model, dict):
        return "it was not converted from a model checkpoint"
    # The same weights, converted by a strata-stream that wrote another activation for them
    # (before pack format version 4, gemma4's experts were written as swiglu).
    want = converted_activation(model_path, geometry.gated)
    if want is not None:
        name, alpha, limit = want
        try:
            now = replace(geometry, activation=name, act_alpha=alpha, act_limit=limit)
        except ConfigError:
            now = geometry
        if now != geometry:
            return (
                f"it computes the experts with activation {geometry.activation}, and the "
                f"model's config.json names {name}"
            )
    return source_mismatch(pack_path, model, crc, model_path, share, progress)


def other_model(pack_path: Path, model_path: Path) -> str | None:
    """The model a pack was converted from, where that is not `model_path` (by the source path
    and architecture its metadata records); None where it is this one or the pack says not."""
    try:
        with ExpertPack.open(pack_path) as pack:
            source = pack.metadata.get("source")
            arch = pack.metadata.get("architecture")
    except PackError:
        return None
    if not isinstance(source, str) or not source:
        return None
    with contextlib.suppress(OSError):
        if Path(source).resolve() == model_path.resolve():
            return None
    return f"{source} ({arch})" if isinstance(arch, str) and arch else source


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise ConfigError(
            f"the pack cache {lock_path.parent} is not writable ({e.strerror or e}): set "
            "STRATA_CACHE to a writable directory, or convert with -o PACK and pass --pack PACK"
        ) from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released by close, also when the process dies
        yield
    finally:
        os.close(fd)


def _identity(path: Path) -> tuple[int, int, int] | None:
    """(device, inode, mtime) of a file, None where it does not exist."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_mtime_ns


def _say(progress: bool, text: str) -> None:
    if progress:
        print(f"strata-stream: {text}", file=sys.stderr)


def ensure_pack(
    model_path: Path,
    pack_path: str | os.PathLike[str] | None = None,
    *,
    share: Share = WHOLE,
    progress: bool = True,
) -> Path:
    """The pack of the checkpoint at `model_path` for `share`, converted if needed (see the
    module docstring). Raises PackError for a named pack made from other weights."""
    if pack_path is not None:
        named = Path(pack_path)
        if not named.exists():
            _say(progress, f"converting the experts of {model_path} ({share.describe()}) "
                 f"into {named}")  # fmt: skip
            return convert(model_path, named, progress=progress, share=share)
        reason = stale_reason(named, model_path, share, progress)
        if reason is not None:
            other = other_model(named, model_path)
            if other is not None:  # never advise overwriting another model's pack
                raise PackError(
                    f"pack {named} was not made from the weights in {model_path}: it belongs to "
                    f"another model, converted from {other}; convert this model into a pack of "
                    f"its own (strata-stream convert {model_path} -o NEW.strpk) and pass that, or "
                    "leave out the pack to use the cache"
                )
            raise PackError(
                f"pack {named} was not made from the weights in {model_path}: {reason}; convert "
                f"it again (strata-stream convert {model_path} -o {named}) or leave out the pack "
                "to use the cache"
            )
        return named

    pack = default_pack_path(model_path, share)
    # An up-to-date entry is read without writing anything (no lock file, no directory): a
    # read-only cache serves it.
    seen = _identity(pack)
    reason = None if seen is None else stale_reason(pack, model_path, share, progress)
    if seen is not None and reason is None:
        return pack
    try:
        pack.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"cannot make the pack cache {pack.parent} ({e.strerror or e}): set STRATA_CACHE to "
            "a writable directory"
        ) from e
    remove_leftovers(pack.parent)
    with _locked(pack.with_name(f".{pack.name}.lock")):
        now = _identity(pack)
        if now is not None:
            # Another process may have converted it while this one waited for the lock.
            if now != seen:
                reason = stale_reason(pack, model_path, share, progress)
            if reason is None:
                return pack
            _say(True, f"the cached pack {pack} is out of date ({reason}): converting again")
        _say(progress, f"converting the experts of {model_path} ({share.describe()}) into "
             f"{pack}")  # fmt: skip
        return convert(model_path, pack, progress=progress, share=share)
