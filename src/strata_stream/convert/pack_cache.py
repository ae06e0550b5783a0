"""The pack a model loads with: found in the cache (converted on first use), or named by the user.

Without a pack path, a model's pack lives in ``cache_dir()/packs`` under a name derived from the
model's path, config and shard sizes (`default_pack_path`), converted there on first load and
reused afterwards. A pack the user names is converted into if it does not exist. Every
front-end (strata_stream.mlx_lm, strata_stream.transformers) shares this cache.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from strata_stream.convert import convert
from strata_stream.convert.share import WHOLE, Share
from strata_stream.paths import cache_dir


def default_pack_path(model_path: Path, share: Share = WHOLE) -> Path:
    """Where `load` keeps the pack of a model it converted: the cache directory, under a name
    derived from the model's path, config and weight files (so a changed model converts anew),
    ending in the share's suffix for one rank of a distributed model (convert/share.py)."""
    h = hashlib.sha256(str(model_path.resolve()).encode())
    config = model_path / "config.json"
    if config.exists():
        h.update(config.read_bytes())
    for f in sorted(model_path.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    name = f"{model_path.name}-{h.hexdigest()[:16]}{share.suffix()}.strpk"
    return cache_dir() / "packs" / name


def ensure_pack(
    model_path: Path,
    pack_path: str | os.PathLike[str] | None = None,
    *,
    share: Share = WHOLE,
    progress: bool = True,
) -> Path:
    """The pack of the checkpoint at `model_path` for `share`: `pack_path` or the cached one,
    converted (with a progress bar when `progress`) if it does not exist yet."""
    pack = Path(pack_path) if pack_path is not None else default_pack_path(model_path, share)
    if pack.exists():
        return pack
    if pack_path is None:
        pack.parent.mkdir(parents=True, exist_ok=True)
    if progress:
        print(f"strata-stream: converting the experts of {model_path} ({share.describe()}) "
              f"into {pack}", file=sys.stderr)  # fmt: skip
    return convert(model_path, pack, progress=progress, share=share)
