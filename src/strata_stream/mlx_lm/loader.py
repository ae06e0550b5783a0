"""`load` / `load_model`: an mlx-lm model whose routed experts stream from a pack.

The model is built lazily by mlx-lm, every MoE block gets its streamed stand-in (blocks.py), and
only then are the parameters evaluated: the dense weights load, the expert tensors are never
read by MLX. Without a pack one is converted on first load into the cache directory.
"""

from __future__ import annotations

import os
import re
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from strata_stream.arena_budget import arena_size, available_memory
from strata_stream.config import StreamConfig
from strata_stream.convert.pack_cache import default_pack_path, ensure_pack
from strata_stream.convert.share import WHOLE, Share
from strata_stream.engine_stats import window_stats_source
from strata_stream.errors import ConfigError, PackError
from strata_stream.mlx_lm.blocks import StreamedExperts, StreamedMoE, strip_experts
from strata_stream.mlx_lm.engine import EXPERT_MODES, BlockRef, MoeEngine
from strata_stream.mlx_lm.families import family_of
from strata_stream.pack.reader import ExpertPack
from strata_stream.paths import checked_model_dir, fetched, model_location

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _find_blocks(model: Any) -> list[tuple[int, str, Any, Any, str]]:
    """(decoder layer, block path, parent module, block, attribute) of every MoE block."""
    found = []
    modules = dict(model.named_modules())
    for name, module in modules.items():
        if type(module).__name__ != "SwitchGLU":
            continue
        block_path, _, _ = name.rpartition(".")
        m = _LAYER.search(block_path + ".")
        if m is None:
            continue
        parent_path, _, attr = block_path.rpartition(".")
        found.append((int(m.group(1)), block_path, modules[parent_path], modules[block_path], attr))
    found.sort(key=lambda t: t[0])
    return found


def _check_pack(
    pack: ExpertPack, decoder_layers: list[int], blocks: list[Any], share: Share = WHOLE
) -> None:
    meta = pack.metadata.get("model") or {}
    where = f"pack {pack.path}"
    if pack.geometry.routing != "external":
        raise PackError(f"{where}: not converted from a model checkpoint (routing is not external)")
    held = Share.from_json(meta.get("share"))
    if held != share:
        raise PackError(
            f"{where}: holds {held.describe()} of the model's experts, but this process needs "
            f"{share.describe()} (a pack converted for another rank or layout?)"
        )
    if meta.get("decoder_layers") != decoder_layers:
        raise PackError(
            f"{where}: holds the experts of decoder layers {meta.get('decoder_layers')}, but the "
            f"model's MoE blocks are at {decoder_layers} (a pack of another model?)"
        )
    g = pack.geometry
    for layer, block in zip(decoder_layers, blocks, strict=True):
        switch = block[family_of(block).experts_attr]
        gp = switch.gate_proj
        n_experts, rows = gp.weight.shape[0], gp.weight.shape[1]
        if rows != g.moe_intermediate:
            raise PackError(
                f"{where}: experts of intermediate width {g.moe_intermediate}, the model's "
                f"layer {layer} has {rows}"
            )
        if n_experts != g.n_experts:
            raise PackError(
                f"{where}: {g.n_experts} experts per layer, the model's layer {layer} has "
                f"{n_experts}"
            )
        bits = getattr(gp, "bits", None)
        if bits is None:
            continue
        mode = getattr(gp, "mode", "affine")
        model_format = "mxfp4" if mode == "mxfp4" else f"q{bits}" if mode == "affine" else mode
        if pack.weight_format != model_format or getattr(gp, "group_size", 0) != pack.group_size:
            raise PackError(
                f"{where}: experts stored as {pack.weight_format} group {pack.group_size}, the "
                f"model's are {model_format} group {gp.group_size}"
            )


def load_model(
    path_or_repo: str | os.PathLike[str],
    *,
    arena_bytes: int | None = None,
    config: StreamConfig | None = None,
    pack_path: str | os.PathLike[str] | None = None,
    experts: str = "cpu",
    arithmetic: str = "auto",
    progress: bool = True,
    lazy: bool = False,
    strict: bool = True,
    model_config: dict[str, Any] | None = None,
    trust_remote_code: bool = False,
) -> tuple[Any, dict[str, Any]]:
    """As ``mlx_lm.utils.load_model``, with the routed experts streamed.

    arena_bytes: expert memory (None: sized from available memory after the dense weights,
    leaving headroom for the KV cache). config: the StreamConfig (default: from the
    environment); arena_bytes wins over config.arena_bytes when given. pack_path: the pack of
    this model (default: converted on first load into strata_stream.paths.cache_dir()).
    experts: "cpu" (the CPU backend computes the experts), "mlx" (MLX's gather_qmm over the
    arena) or "metal" (the engine's Metal backend: macOS builds only, not yet run on a Mac).
    arithmetic (experts="cpu"): "auto" (default) reproduces mlx-lm's own CPU arithmetic
    bitwise wherever the pack allows (q4/q8 experts with bfloat16 or float32 scales, or mxfp4
    experts), else
    float32; "mlx" insists on it; "float32" rounds each output once (faster, not bitwise).
    `lazy` is accepted for signature compatibility: the dense weights are evaluated
    unless it is True; the experts are never loaded either way.
    """
    from mlx_lm.utils import load_model as mlx_load_model

    if experts not in EXPERT_MODES:
        raise ConfigError(f"experts must be one of {', '.join(EXPERT_MODES)}, got {experts!r}")
    model_path = Path(path_or_repo)
    model, model_cfg = mlx_load_model(
        model_path,
        lazy=True,
        strict=strict,
        model_config=model_config,
        trust_remote_code=trust_remote_code,
    )
    stream_experts(
        model,
        model_path,
        arena_bytes=arena_bytes,
        config=config,
        pack_path=pack_path,
        experts=experts,
        arithmetic=arithmetic,
        progress=progress,
        lazy=lazy,
    )
    return model, model_cfg


def stream_experts(
    model: Any,
    model_path: Path,
    *,
    arena_bytes: int | None,
    config: StreamConfig | None,
    pack_path: str | os.PathLike[str] | None,
    experts: str,
    progress: bool,
    lazy: bool,
    arithmetic: str = "auto",
    share: Share = WHOLE,
    memory_share: int = 1,
) -> MoeEngine | None:
    """Puts the streamed stand-ins into a lazily built mlx-lm `model` (already sharded or
    pipelined for `share`, see distributed.py), then evaluates its dense weights. The pack is
    `share`'s (converted on first use). Without arena_bytes the arena is sized from the
    memory available once the dense weights are loaded, divided by `memory_share` (the ranks
    sharing this machine). Returns the engine, or None when the model
    holds no MoE block (a pipeline rank of dense layers only)."""
    if experts not in EXPERT_MODES:
        raise ConfigError(f"experts must be one of {', '.join(EXPERT_MODES)}, got {experts!r}")
    found = _find_blocks(model)
    if not found:
        if share.whole:
            raise ConfigError(f"{model_path}: the model has no MoE blocks with routed experts")
        if not lazy:
            mx.eval(model.parameters())
        return None
    # The cached pack (converted on first use, again when the weights changed) or the one
    # named, refused if it was made from other weights (convert/pack_cache.py).
    pack_file = ensure_pack(model_path, pack_path, share=share, progress=progress)

    decoder_layers = [t[0] for t in found]
    blocks = [t[3] for t in found]
    with ExpertPack.open(pack_file) as pack:
        _check_pack(pack, decoder_layers, blocks, share)
        refs = [
            BlockRef(i, layer, block, family_of(block))
            for i, (layer, block) in enumerate(zip(decoder_layers, blocks, strict=True))
        ]
        # Strip the experts first, so evaluating the parameters loads the dense weights only.
        streamed: list[tuple[Any, str, Any]] = []
        for ref, (_, _, parent, block, attr) in zip(refs, found, strict=True):
            switch = block[ref.family.experts_attr]
            if experts == "mlx":
                stand_in: Any = _Deferred(ref, switch)
                block[ref.family.experts_attr] = stand_in
            else:
                stand_in = _Deferred(ref, None)
                parent[attr] = stand_in
            streamed.append((parent, attr, stand_in))
            strip_experts(switch)
        if not lazy:
            mx.eval(model.parameters())
        base = config if config is not None else StreamConfig.from_env()
        available = available_memory() // memory_share if memory_share > 1 else None
        cfg = base.replace(arena_bytes=arena_size(pack, arena_bytes, available))
        engine = MoeEngine(pack, cfg, experts, refs, arithmetic)
    for ref, (parent, attr, deferred) in zip(refs, streamed, strict=True):
        assert isinstance(deferred, _Deferred)
        if experts == "mlx":
            ref.block[ref.family.experts_attr] = StreamedExperts(engine, ref, deferred.switch)
        else:
            parent[attr] = StreamedMoE(engine, ref)
    if not lazy:
        # On the CPU path each block was out of the model while the parameters above were
        # evaluated: its gate and shared experts are evaluated now, on the loading thread. Left
        # lazy, they would load on whichever thread first runs the model, and MLX refuses to
        # evaluate there an array made on another thread's stream (a server's worker thread).
        mx.eval(model.parameters())
    object.__setattr__(model, "strata_engine", engine)
    object.__setattr__(model, "strata_pack_path", pack_file)
    weakref.finalize(model, engine.close)
    return engine


class _Deferred(nn.Module):  # type: ignore[misc,name-defined]
    """Placeholder while the engine does not exist yet (the arena is sized after the dense
    weights are loaded)."""

    def __init__(self, ref: BlockRef, switch: Any | None) -> None:
        super().__init__()
        object.__setattr__(self, "ref", ref)
        object.__setattr__(self, "switch", switch)


def load(
    path_or_repo: str | os.PathLike[str],
    *,
    arena_bytes: int | None = None,
    config: StreamConfig | None = None,
    pack_path: str | os.PathLike[str] | None = None,
    experts: str = "cpu",
    arithmetic: str = "auto",
    progress: bool = True,
    tokenizer_config: dict[str, Any] | None = None,
    model_config: dict[str, Any] | None = None,
    adapter_path: str | None = None,
    lazy: bool = False,
    return_config: bool = False,
    revision: str | None = None,
    trust_remote_code: bool = False,
) -> Any:
    """As ``mlx_lm.load``: (model, tokenizer) [+ config], the routed experts streamed.

    The model works unchanged with mlx_lm.generate, stream_generate, generate_step, prompt
    caches and samplers. See `load_model` for arena_bytes, config, pack_path, experts and
    arithmetic.
    A Hugging Face repo id is downloaded by mlx-lm first.
    """
    from mlx_lm.utils import _download, load_adapters, load_tokenizer

    # A mistyped local path is refused here, not looked up as a repo on the network.
    location = model_location(path_or_repo)
    snapshot = fetched(location, lambda: _download(location, revision=revision))
    model_path = checked_model_dir(snapshot)
    model, model_cfg = load_model(
        model_path,
        arena_bytes=arena_bytes,
        config=config,
        pack_path=pack_path,
        experts=experts,
        arithmetic=arithmetic,
        progress=progress,
        lazy=lazy,
        model_config=model_config,
        trust_remote_code=trust_remote_code,
    )
    if adapter_path is not None:
        model = load_adapters(model, adapter_path)
        model.eval()
    tokenizer = load_tokenizer(  # type: ignore[no-untyped-call]
        model_path, tokenizer_config, eos_token_ids=model_cfg.get("eos_token_id", None)
    )
    if return_config:
        return model, tokenizer, model_cfg
    return model, tokenizer


def describe(model: Any) -> dict[str, Any]:
    """The streaming engine's figures for a model `load` returned (Window.stats() and more)."""
    engine: MoeEngine = model.strata_engine
    stats = engine.window.stats()
    stats["experts"] = engine.experts
    stats["arena_bytes"] = engine.config.arena_bytes
    stats["n_slots"] = engine.stream.n_slots
    stats["zero_copy"] = bool(engine.arena and engine.arena.zero_copy)
    return stats


def stats_source(model: Any) -> Callable[[], Mapping[str, Any]]:
    """A snapshot function of the engine under a model `load` returned, in the schema the
    server's metrics read (`strata_stream.engine_stats`: hits, misses, bytes_read, stall_s,
    slots_in_use, slots_total, pred_correct, pred_predicted, pred_actual, per_layer_hit_rate).
    Call it from the thread that generates."""
    engine: MoeEngine = model.strata_engine
    return window_stats_source(engine.window)


__all__ = ["arena_size", "default_pack_path", "describe", "load", "load_model", "stats_source"]
