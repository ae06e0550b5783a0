"""Which modules of a transformers model are experts of its experts interface, and how the
interface declares a fused gate_up_proj's gate/up split: what the converter needs to know of a
checkpoint's transformers model, without the transformers front-end (which imports the
converter, not the other way round). strata_stream.transformers.families re-exports these."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

# The flags use_experts_implementation sets on every experts module it decorates.
_MARKERS = ("has_gate", "has_bias", "is_transposed", "is_concatenated")


def is_experts_module(module: Any) -> bool:
    """An experts module of transformers' experts interface: the decorator's marker and a
    forward taking (hidden_states, top_k_index, top_k_weights)."""
    import torch

    if not isinstance(module, torch.nn.Module):
        return False
    if not all(isinstance(getattr(module, m, None), bool) for m in _MARKERS):
        return False
    if not callable(getattr(type(module), "_apply_gate", None)):
        return False
    try:
        params = inspect.signature(type(module).forward).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 4  # self, hidden_states, top_k_index, top_k_weights


def find_blocks(model: Any) -> list[tuple[str, Any, Any]]:
    """(path, block, experts module) of every experts-interface module in `model`, the block
    being the module that holds it as its ``experts``-like child."""
    found = []
    modules = dict(model.named_modules())
    for name, module in modules.items():
        if not name or not is_experts_module(module):
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = modules.get(parent_name)
        if parent is None:
            continue
        found.append((parent_name, parent, attr))
    return found


# The Auto classes `declared_concatenated` builds a checkpoint's model as, the first that maps
# its config: every experts module a load builds is in one of them.
_META_CLASSES = (
    "AutoModel", "AutoModelForCausalLM", "AutoModelForImageTextToText",
    "AutoModelForTokenClassification",
)  # fmt: skip


def declared_concatenated(model_dir: Path) -> bool | None:
    """How the experts modules transformers builds for the checkpoint at `model_dir` split a
    transposed gate_up_proj [E, H, 2I]: gate columns then up columns (True) or interleaved
    column by column (False), by the decorator's is_concatenated (the marker Family.concatenated
    reads too: the one rule for that split). The model is built from config.json on the meta
    device (no weight is read, no remote code run). None where transformers is not importable
    or cannot build it, where it has no such module, or where its modules disagree."""
    try:
        import torch
        import transformers
    except ImportError:
        return None
    try:
        config = transformers.AutoConfig.from_pretrained(str(model_dir))
    except Exception:  # noqa: BLE001 - a config transformers cannot read: the marker is unknown
        return None
    model = None
    for name in _META_CLASSES:
        try:
            with torch.device("meta"):
                model = getattr(transformers, name).from_config(config)
            break
        except Exception:  # noqa: BLE001 - this Auto class does not map (or build) the config
            continue
    if model is None:
        return None
    found = {
        bool(experts.is_concatenated)
        for _, block, attr in find_blocks(model)
        for experts in [getattr(block, attr)]
        if experts.has_gate and experts.is_transposed
    }
    return found.pop() if len(found) == 1 else None
