"""The transformers engine's prompt caches (serve/prompt_cache.py): transformers' DynamicCache
of full-attention layers (DynamicLayer), trimmed with its own `crop`, persisted as its key and
value tensors per layer with `safetensors.torch` and rebuilt with DynamicCache's own
constructor. Other caches (sliding-window, linear-attention, quantized layers) are kept in
memory only and serve only a prompt that starts with all of their tokens."""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path
from typing import Any, cast

import torch


def _plain(cache: Any) -> bool:
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    return type(cache) is DynamicCache and all(type(x) is DynamicLayer for x in cache.layers)


def _bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
    return memoryview(cast(Any, flat.numpy()))


class TorchCacheOps:
    format = "transformers-dynamic"

    def __init__(self, model: Any) -> None:
        self._device = getattr(model, "device", torch.device("cpu"))
        config = getattr(model, "config", None)
        text = config.get_text_config(decoder=True) if config is not None else None
        self._layers = getattr(text, "num_hidden_layers", None)

    def nbytes(self, cache: Any) -> int:
        total = 0
        for layer in getattr(cache, "layers", []):
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
        return total

    def trimmable(self, cache: Any) -> bool:
        return _plain(cache)

    def storable(self, cache: Any) -> bool:
        return _plain(cache)

    def copy(self, cache: Any) -> Any:
        return copy.deepcopy(cache)

    def trim_to(self, cache: Any, n_tokens: int) -> None:
        # A negative count removes that many tokens in every transformers version (a positive
        # one was the length to keep, and is refused from 5.x on).
        drop = self.length(cache) - n_tokens
        if drop > 0:
            cache.crop(-drop)

    def length(self, cache: Any) -> int:
        return int(cache.get_seq_length())

    def fits(self, cache: Any) -> bool:
        layers = getattr(cache, "layers", None)
        if layers is None:
            return False
        return self._layers is None or len(layers) == self._layers

    def digest(self, cache: Any) -> str:
        h = hashlib.blake2b(digest_size=32)
        for layer in cache.layers:
            for t in (layer.keys, layer.values):
                h.update(f"{t.dtype}|{tuple(t.shape)}|".encode())
                h.update(_bytes(t))
        return h.hexdigest()

    def save(self, path: Path, cache: Any, metadata: dict[str, str]) -> None:
        from safetensors.torch import save_file

        tensors: dict[str, torch.Tensor] = {}
        for i, layer in enumerate(cache.layers):
            tensors[f"layers.{i}.keys"] = layer.keys.detach().contiguous().cpu()
            tensors[f"layers.{i}.values"] = layer.values.detach().contiguous().cpu()
        save_file(tensors, str(path), metadata=metadata)

    def load(self, path: Path) -> Any:
        from safetensors.torch import load_file
        from transformers import DynamicCache

        tensors = load_file(str(path), device=str(self._device))
        n = len(tensors) // 2
        if set(tensors) != {f"layers.{i}.{kv}" for i in range(n) for kv in ("keys", "values")}:
            raise ValueError("its tensors are not a DynamicCache's keys and values")
        data = [(tensors[f"layers.{i}.keys"], tensors[f"layers.{i}.values"]) for i in range(n)]
        return DynamicCache(data)


def torch_fingerprints(model: Any) -> tuple[str, str]:
    """(the model's weights' digest, the pack's): what a cache file must match."""
    from strata_stream.serve.prompt_cache import pack_fingerprint, weights_fingerprint

    named = []
    for name, t in model.state_dict().items():
        named.append((name, _bytes(t), str(t.dtype), tuple(t.shape)))
    return weights_fingerprint(named), pack_fingerprint(model)
