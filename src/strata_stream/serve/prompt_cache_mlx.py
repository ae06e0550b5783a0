"""The mlx-lm engine's prompt caches (serve/prompt_cache.py) through mlx-lm's own functions:
make_prompt_cache for the model's cache layout, can_trim_prompt_cache / trim_prompt_cache to
serve part of a cache, save_prompt_cache / load_prompt_cache for the files."""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path
from typing import Any, cast


def _arrays(cache: list[Any]) -> list[Any]:
    from mlx.utils import tree_flatten

    flat = cast(list[tuple[str, Any]], tree_flatten([c.state for c in cache]))
    return [a for _, a in flat]


class MlxCacheOps:
    format = "mlx-lm"

    def __init__(self, model: Any) -> None:
        from mlx_lm.models.cache import make_prompt_cache

        # The model's own layout: a cache of other layers or classes is not this model's.
        self._classes = [type(c).__name__ for c in make_prompt_cache(model)]

    def nbytes(self, cache: Any) -> int:
        return int(sum(c.nbytes for c in cache))

    def trimmable(self, cache: Any) -> bool:
        from mlx_lm.models.cache import can_trim_prompt_cache

        return bool(can_trim_prompt_cache(cache))

    def storable(self, cache: Any) -> bool:
        return True

    def copy(self, cache: Any) -> Any:
        return copy.deepcopy(cache)

    def trim_to(self, cache: Any, n_tokens: int) -> None:
        from mlx_lm.models.cache import trim_prompt_cache

        trim_prompt_cache(cache, self.length(cache) - n_tokens)

    def length(self, cache: Any) -> int:
        return int(cache[0].offset) if cache else 0

    def fits(self, cache: Any) -> bool:
        return [type(c).__name__ for c in cache] == self._classes and all(
            int(c.offset) == int(cache[0].offset) for c in cache
        )

    def digest(self, cache: Any) -> str:
        import mlx.core as mx

        h = hashlib.blake2b(digest_size=32)
        for a in _arrays(cache):
            if isinstance(a, mx.array):
                mx.eval(a)
                h.update(f"{a.dtype}|{a.shape}|".encode())
                # Viewed as bytes: the buffer protocol does not name every dtype (bfloat16).
                h.update(memoryview(cast(Any, a.view(mx.uint8) if a.size and a.ndim else a)))
            else:
                h.update(repr(a).encode())
        return h.hexdigest()

    def save(self, path: Path, cache: Any, metadata: dict[str, str]) -> None:
        from mlx_lm.models.cache import save_prompt_cache

        save_prompt_cache(str(path), cache, metadata)

    def load(self, path: Path) -> Any:
        from mlx_lm.models.cache import load_prompt_cache

        return load_prompt_cache(str(path))  # type: ignore[no-untyped-call]


def mlx_fingerprints(model: Any) -> tuple[str, str]:
    """(the model's dense weights' digest, the pack's): what a cache file must match."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from strata_stream.serve.prompt_cache import pack_fingerprint, weights_fingerprint

    named = []
    params = cast(list[tuple[str, Any]], tree_flatten(model.parameters()))
    for name, a in params:
        mx.eval(a)
        data = memoryview(cast(Any, a.view(mx.uint8) if a.size and a.ndim else a))
        named.append((name, data, str(a.dtype), tuple(a.shape)))
    return weights_fingerprint(named), pack_fingerprint(model)
