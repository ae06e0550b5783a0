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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from strata_stream.arena_budget import arena_size, available_memory
from strata_stream.config import StreamConfig
from strata_stream.convert.pack_cache import default_pack_path, ensure_pack
from strata_stream.convert.share import WHOLE, Share
from strata_stream.engine_stats import window_stats_source
from strata_stream.errors import ConfigError, PackError
from strata_stream.mlx_lm.blocks import (
    GLU_MATRICES,
    StreamedSwitch,
    cpu_activation,
    is_glu,
    strip_experts,
    switch_classes,
)
from strata_stream.mlx_lm.engine import EXPERT_MODES, BlockRef, MoeEngine
from strata_stream.mlx_lm.prediction import Predictor
from strata_stream.pack.reader import ExpertPack
from strata_stream.paths import checked_model_dir, fetched, model_location

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass
class _Found:
    """One switch of the model: where it sits and who calls it."""

    decoder_layer: int
    path: str  # the switch's module path
    parent: Any  # the module holding it as attribute `attr` (the block that calls it)
    attr: str
    switch: Any
    decoder: Any  # the decoder layer module (layers.N), where a router may live


def _model_type(model: Any) -> str:
    args = getattr(model, "args", None)
    return str(getattr(args, "model_type", None) or type(model).__module__.rpartition(".")[2])


def _find_switches(model: Any) -> list[_Found]:
    """Every experts module (mlx-lm's SwitchGLU/SwitchMLP) under a decoder layer, in layer
    order: the seam, whatever the block around it."""
    classes = switch_classes()
    modules = dict(model.named_modules())
    found: list[_Found] = []
    for name, module in modules.items():
        if not isinstance(module, classes):
            continue
        m = _LAYER.search(name + ".")
        if m is None:
            continue
        parent_path, _, attr = name.rpartition(".")
        decoder_path = name[: m.end() - 1].lstrip(".")
        found.append(
            _Found(
                int(m.group(1)),
                name,
                modules[parent_path],
                attr,
                module,
                modules.get(decoder_path),
            )
        )
    found.sort(key=lambda f: f.decoder_layer)
    layers = [f.decoder_layer for f in found]
    if len(set(layers)) != len(layers):
        dup = sorted({n for n in layers if layers.count(n) > 1})
        raise ConfigError(
            f"{_model_type(model)}: decoder layers {dup} hold more than one experts module "
            "(the pack holds one per layer)"
        )
    for f in found:
        if not is_glu(f.switch):
            raise ConfigError(
                f"{_model_type(model)}: its experts are mlx-lm SwitchMLP modules (one input "
                f"projection and {type(f.switch.activation).__name__}, at {f.path}); the pack "
                "holds gated experts (gate, up, down) only"
            )
    return found


def _check_pack(pack: ExpertPack, found: list[_Found], share: Share = WHOLE) -> None:
    decoder_layers = [f.decoder_layer for f in found]
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
    for pack_layer, f in enumerate(found):
        layer = f.decoder_layer
        gp = f.switch.gate_proj
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
        for name, stored in zip(GLU_MATRICES, pack.formats_of(pack_layer), strict=True):
            linear = f.switch[name]
            bits = getattr(linear, "bits", None)
            if bits is None:  # unquantized: a pack may hold it quantized (convert --quantize)
                continue
            mode = getattr(linear, "mode", "affine")
            model_format = "mxfp4" if mode == "mxfp4" else f"q{bits}" if mode == "affine" else mode
            group = getattr(linear, "group_size", 0)
            if (stored.weight_format, stored.group_size) != (model_format, group):
                raise PackError(
                    f"{where}: layer {layer} {name} stored as {stored.describe()}, the model's "
                    f"is {model_format} group {group}"
                )


def _kernels(pack: ExpertPack, switch: Any, experts: str) -> str:
    """Who computes this switch's experts: the Window's backend ("cpu") when it computes the
    switch's own activation as the pack records it, else the switch's own modules ("mlx")."""
    if experts == "mlx":
        return "mlx"
    act = cpu_activation(switch)
    g = pack.geometry
    if act is None or act[0] != g.activation:
        return "mlx"
    f32 = np.float32
    if act[0] == "swiglu_oai" and (
        f32(act[1]) != f32(g.act_alpha) or f32(act[2]) != f32(g.act_limit)
    ):
        return "mlx"
    return "cpu"


def load_model(
    path_or_repo: str | os.PathLike[str],
    *,
    arena_bytes: int | str | None = None,
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
    arena_bytes: int | str | None,
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
    found = _find_switches(model)
    if not found:
        if share.whole:
            raise ConfigError(
                f"{model_path}: the model ({_model_type(model)}) has no MoE blocks with routed "
                "experts (no mlx-lm SwitchGLU/SwitchMLP module)"
            )
        if not lazy:
            mx.eval(model.parameters())
        return None
    # The cached pack (converted on first use, again when the weights changed) or the one
    # named, refused if it was made from other weights (convert/pack_cache.py).
    pack_file = ensure_pack(model_path, pack_path, share=share, progress=progress)

    with ExpertPack.open(pack_file) as pack:
        _check_pack(pack, found, share)
        refs = [
            BlockRef(i, f.decoder_layer, f.parent, f.switch, _kernels(pack, f.switch, experts))
            for i, f in enumerate(found)
        ]
        # Strip the experts first, so evaluating the parameters loads the dense weights only;
        # a placeholder holds each switch's place until the engine exists.
        for f in found:
            strip_experts(f.switch)
            f.parent[f.attr] = _Deferred()
        if not lazy:
            mx.eval(model.parameters())
        base = config if config is not None else StreamConfig.from_env()
        available = available_memory() // memory_share if memory_share > 1 else None
        cfg = base.replace(arena_bytes=arena_size(pack, arena_bytes, available))
        engine = MoeEngine(pack, cfg, experts, refs, arithmetic)
    top_k, n_experts = engine.top_k, engine.stream.n_experts
    for ref, f in zip(refs, found, strict=True):
        stand_in = StreamedSwitch(engine, ref, f.switch, ref.kernels)
        f.parent[f.attr] = stand_in
        ref.predictor = Predictor(f.parent, stand_in, f.decoder, top_k, n_experts)
    if not lazy:
        # Anything of the model still lazy (evaluated now, on the loading thread): left lazy,
        # it would load on whichever thread first runs the model, and MLX refuses to evaluate
        # there an array made on another thread's stream (a server's worker thread).
        mx.eval(model.parameters())
    object.__setattr__(model, "strata_engine", engine)
    object.__setattr__(model, "strata_pack_path", pack_file)
    weakref.finalize(model, engine.close)
    return engine


class _Deferred(nn.Module):  # type: ignore[misc,name-defined]
    """Holds a switch's place while the engine does not exist yet (the arena is sized after
    the dense weights are loaded); no parameters."""


def load(
    path_or_repo: str | os.PathLike[str],
    *,
    arena_bytes: int | str | None = None,
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
    # Per pack layer: who computes its experts ("cpu": the Window's backend; "mlx": the
    # switch's own modules, for an activation the backend does not compute) and how its
    # experts are predicted (prediction.METHODS; "profile" where the block's routing could
    # not be reached, with the reason).
    stats["kernels"] = [b.kernels for b in engine.blocks]
    stats["prediction"] = engine.prediction_methods()
    stats["prediction_why"] = {
        b.layer: b.predictor.why
        for b in engine.blocks
        if b.predictor is not None and b.predictor.method == "profile"
    }
    return stats


def stats_source(model: Any) -> Callable[[], Mapping[str, Any]]:
    """A snapshot function of the engine under a model `load` returned, in the schema the
    server's metrics read (`strata_stream.engine_stats`: hits, misses, bytes_read, stall_s,
    slots_in_use, slots_total, pred_correct, pred_predicted, pred_actual, per_layer_hit_rate).
    Call it from the thread that generates."""
    engine: MoeEngine = model.strata_engine
    return window_stats_source(engine.window)


__all__ = ["arena_size", "default_pack_path", "describe", "load", "load_model", "stats_source"]
