"""`load`: a transformers model whose routed experts stream from a pack.

transformers builds the model (from_pretrained, on the meta device until the weights arrive);
the class it builds is a subclass of the model's own whose __init__ puts a streamed module
(experts.py) in place of every sparse block's experts module. from_pretrained therefore never
finds a parameter for the checkpoint's expert tensors: it reports them as unexpected keys
(silenced here) and never reads them; the dense weights load as usual. Without a pack one is
converted on first load into the cache strata_stream.mlx_lm uses (convert/pack_cache.py).
"""

from __future__ import annotations

import os
import re
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch

from strata_stream import container_memory
from strata_stream.arena_budget import arena_size
from strata_stream.config import StreamConfig
from strata_stream.convert.pack_cache import ensure_pack
from strata_stream.errors import ConfigError, PackError
from strata_stream.pack.reader import ExpertPack
from strata_stream.paths import model_dir
from strata_stream.transformers.dense_memory import settle
from strata_stream.transformers.engine import BlockRef, TorchMoeEngine
from strata_stream.transformers.experts import EngineSlot, streamed_experts
from strata_stream.transformers.families import Family, check_activation, family_of, find_blocks
from strata_stream.units import human_bytes

_GiB = 1 << 30
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# The checkpoint's expert tensors, as transformers names them once renamed for the model
# (``...mlp.experts.gate_up_proj``, ``...mlp.experts.down_proj_bias``): no parameter takes them.
_EXPERT_KEYS = [r"\.experts\.(?:\d+\.)?(?:gate_up_proj|down_proj|gate_proj|up_proj|w[123])"]


def set_path(path: str) -> str:
    """An experts module's path within its decoder layer (``mlp.text_moe.experts`` of
    ``model.language_model.layers.1.mlp.text_moe.experts``): what tells a decoder layer's
    experts sets apart, in the model and in a checkpoint's tensor names alike."""
    m = _LAYER.search(path + ".")
    return path[m.end() :] if m is not None else path


def _replace_experts(model: torch.nn.Module, slot: EngineSlot) -> None:
    """Every experts-interface module of `model` (families.py), replaced by a streamed one, in
    the pack's order: by decoder layer, and within a decoder layer that holds several experts
    modules (ERNIE-4.5-VL's text and vision experts) by their paths, each its own pack layer
    (convert/checkpoint.py orders a checkpoint's experts sets so). ConfigError (one line) for
    experts the pack cannot hold."""
    model_type = str(getattr(model.config, "model_type", "unknown"))
    found: list[tuple[int, str, Any, str]] = []
    for name, block, attr in find_blocks(model):
        m = _LAYER.search(name + ".")
        if m is not None:
            found.append((int(m.group(1)), name, block, attr))
    found.sort(key=lambda t: (t[0], set_path(f"{t[1]}.{t[3]}")))
    slot.blocks = []
    for layer, (decoder_layer, name, block, attr) in enumerate(found):
        family = family_of(getattr(block, attr), model_type)
        setattr(block, attr, streamed_experts(slot, layer, family, getattr(block, attr)))
        shape = (family.n_experts, family.moe_intermediate, family.hidden)
        slot.blocks.append((decoder_layer, name, block, family, shape, attr))


def _streamed_class(base: type[Any], slot: EngineSlot) -> type[Any]:
    """`base` (the model's own class) building streamed experts modules in place of its own."""

    def __init__(self: Any, config: Any, *args: Any, **kwargs: Any) -> None:
        base.__init__(self, config, *args, **kwargs)
        _replace_experts(self, slot)

    ignore = [*(getattr(base, "_keys_to_ignore_on_load_unexpected", None) or []), *_EXPERT_KEYS]
    return type(
        base.__name__,
        (base,),
        {"__init__": __init__, "__module__": base.__module__,
         "__qualname__": base.__qualname__, "_keys_to_ignore_on_load_unexpected": ignore},
    )  # fmt: skip


def _own_classes(config: Any) -> dict[str, type[Any]]:
    """The classes of the model type's own modeling module that take this config class."""
    import importlib

    from transformers.models.auto.configuration_auto import model_type_to_module_name

    package = model_type_to_module_name(str(getattr(config, "model_type", "")))
    try:
        module = importlib.import_module(f"transformers.models.{package}.modeling_{package}")
    except ImportError:
        return {}
    return {
        n: c
        for n, c in vars(module).items()
        if isinstance(c, type) and getattr(c, "config_class", None) is type(config)
    }


def _own_class(config: Any, suffix: str) -> type[Any] | None:
    """The one class of the model type's own modeling module whose name ends in `suffix` and
    that takes this config class; None where there is not exactly one."""
    found = [c for n, c in _own_classes(config).items() if n.endswith(suffix)]
    return found[0] if len(found) == 1 else None


def _class_of(config: Any, auto: Any, suffix: str) -> type[Any] | None:
    """The class `auto` (an AutoModelFor* class) builds for `config`, found as the library
    finds it: the auto class's table (which picks among several by the config's
    `architectures`); else a class the config's `architectures` names ending in `suffix`; else
    the one such class of the model type's own modeling module taking this config class."""
    import transformers
    from transformers.models.auto import auto_factory

    mapping: Any = auto._model_mapping  # noqa: SLF001 - its class table
    if type(config) in mapping:
        cls: type[Any] = auto_factory._get_model_class(config, mapping)  # type: ignore[no-untyped-call]
        return cls
    for arch in getattr(config, "architectures", None) or []:
        found = getattr(transformers, str(arch), None) if str(arch).endswith(suffix) else None
        if isinstance(found, type):
            return found
    return _own_class(config, suffix)


def causal_lm_class(config: Any, where: object = "") -> type[Any]:
    """The causal-LM class transformers builds for `config`, found as the library finds it
    (`_class_of` with AutoModelForCausalLM; mistral4: not in the auto table, though
    Mistral4ForCausalLM exists and loads plainly). ConfigError where there is none."""
    from transformers import AutoModelForCausalLM

    cls = _class_of(config, AutoModelForCausalLM, "ForCausalLM")
    if cls is not None:
        return cls
    prefix = f"{where}: " if where else ""
    raise ConfigError(
        f"{prefix}transformers has no causal LM class for {type(config).__name__} "
        f"(model type {getattr(config, 'model_type', None) or 'unknown'})"
    )


def generation_class(config: Any, where: object = "") -> type[Any]:
    """The class transformers generates text with for `config`: its causal LM
    (`causal_lm_class`), else the class it builds for image-text-to-text generation (a vision
    or omni model whose generation class is ``*ForConditionalGeneration``: given no image it
    generates from the text alone), found the same way with AutoModelForImageTextToText.
    ConfigError naming the model's own heads where it has neither."""
    from transformers import AutoModelForImageTextToText

    try:
        return causal_lm_class(config)
    except ConfigError:
        pass
    cls = _class_of(config, AutoModelForImageTextToText, "ForConditionalGeneration")
    if cls is not None:
        return cls
    prefix = f"{where}: " if where else ""
    model_type = getattr(config, "model_type", None) or "unknown"
    heads = sorted(n for n in _own_classes(config) if not n.endswith("PreTrainedModel"))
    raise ConfigError(
        f"{prefix}transformers has no text-generation class (causal LM or image-text-to-text) "
        f"for {type(config).__name__} (model type {model_type}; its model classes: "
        f"{', '.join(heads) or 'none'})"
    )


def model_class_for(config: Any, model_class: Any, where: object = "") -> type[Any]:
    """The class `load(..., model_class=...)` builds for `config`: an Auto class (AutoModel,
    AutoModelForTokenClassification, ...) resolved as the library resolves it (`_class_of`:
    its table, else, for an ``AutoModelFor<Head>``, a ``*For<Head>`` class the config's
    `architectures` or the model type's own modeling module names), or a model class that takes
    this config or its text_config. ConfigError (one line) naming the model type and the class
    where transformers cannot build that class from this config."""
    from transformers import PreTrainedModel
    from transformers.models.auto import auto_factory
    from transformers.models.auto.auto_factory import _BaseAutoModelClass

    prefix = f"{where}: " if where else ""
    model_type = getattr(config, "model_type", None) or "unknown"
    name = getattr(model_class, "__name__", None) or " ".join(repr(model_class).split())[:80]
    if isinstance(model_class, type) and issubclass(model_class, _BaseAutoModelClass):
        head = name.removeprefix("AutoModel")
        mapping: Any = model_class._model_mapping  # noqa: SLF001 - its class table
        found: type[Any] | None = None
        if head.startswith("For"):
            found = _class_of(config, model_class, head)
        elif type(config) in mapping:  # AutoModel: its table alone
            found = auto_factory._get_model_class(config, mapping)  # type: ignore[no-untyped-call]
        if found is None:
            raise ConfigError(
                f"{prefix}model_class {name}: transformers maps no class for "
                f"{type(config).__name__} (model type {model_type})"
            )
        cls: type[Any] = found
    elif isinstance(model_class, type) and issubclass(model_class, PreTrainedModel):
        cls = model_class
    else:
        raise ConfigError(
            f"{prefix}model_class {name}: not a transformers model class or Auto class (model "
            f"type {model_type})"
        )
    takes = getattr(cls, "config_class", None)
    if not (isinstance(takes, type) and isinstance(config_for(cls, config), takes)):
        raise ConfigError(
            f"{prefix}model_class {cls.__name__}: transformers cannot build it from "
            f"{type(config).__name__} (model type {model_type}; it takes "
            f"{getattr(takes, '__name__', 'no config class')})"
        )
    return cls


def config_for(cls: type[Any], config: Any) -> Any:
    """The config `cls` takes: a multimodal config's text_config where the causal LM is the
    text model's (as AutoModelForCausalLM does, the parent's quantization_config kept)."""
    sub = (getattr(config, "sub_configs", None) or {}).get("text_config")
    if sub is None or getattr(cls, "config_class", None) is not sub:
        return config
    text = config.get_text_config()
    quant = getattr(config, "quantization_config", None)
    if quant is not None:
        text.quantization_config = quant
    return text


def _device_arg(device: str | torch.device | None) -> torch.device:
    """The device load runs the model on: the CPU, or the GPU the cuda backend runs on (device
    0), checked before any weight is read; ConfigError naming why it cannot be used."""
    if device is None:
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device {device!r}: {e}") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ConfigError(f"device {dev}: strata_stream.transformers runs on the CPU or on CUDA")
    if dev.index not in (None, 0):
        raise ConfigError(
            f"device {dev}: the cuda backend runs on CUDA device 0 (choose the GPU with "
            "CUDA_VISIBLE_DEVICES)"
        )
    if not torch.cuda.is_available():
        raise ConfigError(f"device {dev}: this torch sees no CUDA GPU (torch {torch.__version__})")
    from strata_stream.window import cuda_backend_unavailable

    why = cuda_backend_unavailable()
    if why:
        raise ConfigError(f"device {dev}: {why}")
    return torch.device("cuda", 0)


def _arena_bytes(
    pack: ExpertPack,
    requested: int | None,
    device: torch.device,
    dense: int,
    pending: int | None = None,
) -> int:
    """The arena for `device`. On CUDA the arena is host memory (the stream's, which the IO
    threads fill) mirrored slot for slot in GPU memory (docs/cuda.md), so it must fit both:
    sized from the GPU memory free once the dense weights are there, with the KV cache's
    headroom (arena_budget), and from host memory likewise. `dense`: the dense weights' bytes
    in host memory as dense_memory.settle counts them, `pending` the part of them no container
    charge holds yet (the rows a step reads of an embedding left mapped): counted once."""
    host = arena_size(pack, requested, dense_bytes=dense, dense_pending=pending)
    if device.type != "cuda":
        return host
    torch.cuda.empty_cache()  # torch's cached blocks are free for the arena too
    free = int(torch.cuda.mem_get_info(device)[0])
    if requested is not None:
        if host > free:
            raise ConfigError(
                f"arena_bytes {requested} does not fit in {device}: {free / _GiB:.2f} GiB of GPU "
                "memory is free after the dense weights"
            )
        return host
    return min(host, arena_size(pack, None, available=free, memory="GPU memory"))


def _held_back_message(held_back: int) -> str:
    cap, left = container_memory.binding() or (0, 0)  # held back only where one binds
    return (
        f"not enough memory for the dense weights: every token reads {human_bytes(held_back)} of "
        f"them whole (attention, output head, norms, routers), and {human_bytes(left)} is left "
        f"of this container's {human_bytes(cap)} limit, so they cannot be made resident, and "
        "left mapped the kernel would read them from disk again for every token; raise the "
        "memory limit, or pass arena_bytes to stream the experts anyway"
    )


def _check_pack(pack: ExpertPack, blocks: list[tuple[Any, ...]]) -> None:
    meta = pack.metadata.get("model") or {}
    where = f"pack {pack.path}"
    if pack.geometry.routing != "external":
        raise PackError(f"{where}: not converted from a model checkpoint (routing is not external)")
    decoder_layers = [b[0] for b in blocks]
    if meta.get("decoder_layers") != decoder_layers:
        raise PackError(
            f"{where}: holds the experts of decoder layers {meta.get('decoder_layers')}, but the "
            f"model's sparse blocks are at {decoder_layers} (a pack of another model, or made "
            "from another layout of its experts?)"
        )
    _check_sets(where, meta, blocks)
    g = pack.geometry
    for decoder_layer, _, _, family, (n_experts, inter, hidden), _ in blocks:
        if (g.n_experts, g.moe_intermediate, g.hidden) != (n_experts, inter, hidden):
            raise PackError(
                f"{where}: {g.n_experts} experts of intermediate width {g.moe_intermediate} and "
                f"hidden size {g.hidden}; the model's layer {decoder_layer} has {n_experts} of "
                f"{inter} and {hidden}"
            )
        _check_columns_split(where, meta, family)
        # The pack's activation on the converter's gate/up split must be the experts' own.
        check_activation(family, g.activation, g.act_alpha, g.act_limit, meta.get("layout"))


def _check_columns_split(where: str, meta: dict[str, Any], family: Family) -> None:
    """A pack whose fused gate_up_proj [E, H, 2I] split was not read from the experts module
    (assumed interleaved by a convert that could not build the model, or by an older
    strata-stream) is refused where the experts module's is_concatenated says otherwise, with
    how to convert it again."""
    layout = meta.get("layout")
    if layout not in ("fused_columns", "fused_columns_halves") or not family.transposed:
        return
    halves = layout == "fused_columns_halves"
    if halves == family.concatenated:
        return
    if not (meta.get("columns_split_assumed") or layout == "fused_columns"):
        return  # the split the converter read from the names (aria's fc1): check_activation's
    said = "gate columns then up columns" if halves else "interleaved columns"
    own = "gate columns then up columns" if family.concatenated else "interleaved columns"
    raise ConfigError(
        f"{where} holds the experts' gate_up_proj as {said} (assumed when it was converted), "
        f"but {family.model_type}'s experts module {family.experts_class} holds {own} "
        f"(is_concatenated={family.concatenated}): remove the pack to have load convert it "
        "again, or convert it again where transformers is importable (strata-stream convert "
        "MODEL -o PACK --force)"
    )


def _hook_sets(model: Any, blocks: list[tuple[Any, ...]], engine: TorchMoeEngine) -> None:
    """For each decoder layer holding several experts modules: a forward hook on the module
    that holds them all (ERNIE-4.5-VL's ``mlp``), which moves the Window's turn past the sets
    the pass did not run once that module returns (TorchMoeEngine.leave_sets), so that a pass
    whose tokens never chose the last decoder layer's last set still ends its turn."""
    by_layer: dict[int, list[int]] = {}
    for i, b in enumerate(blocks):
        by_layer.setdefault(b[0], []).append(i)
    for layers in by_layer.values():
        if len(layers) < 2:
            continue
        paths = [str(blocks[i][1]).split(".") for i in layers]
        common: list[str] = []
        for parts in zip(*paths, strict=False):
            if len(set(parts)) != 1:
                break
            common.append(parts[0])
        holder = model.get_submodule(".".join(common))
        last = layers[-1]
        holder.register_forward_hook(lambda *_, last=last: engine.leave_sets(last))


def _check_sets(where: str, meta: Mapping[str, Any], blocks: list[tuple[Any, ...]]) -> None:
    """PackError unless each pack layer of a decoder layer with several experts modules holds
    that module's experts: the checkpoint's experts prefix of each set names the module's path
    where the sets are separate tensors; sets of one per-expert list (`expert_offsets`) are in
    the modules' path order."""
    prefixes = meta.get("experts_prefixes") or []
    offsets = meta.get("expert_offsets") or [0] * len(blocks)
    if len(prefixes) != len(blocks) or len(offsets) != len(blocks):
        raise PackError(f"{where}: its model block does not describe {len(blocks)} experts sets")
    for i, (decoder_layer, name, _, _, _, attr) in enumerate(blocks):
        siblings = [j for j, b in enumerate(blocks) if b[0] == decoder_layer]
        if len(siblings) < 2:
            continue
        shared = len({prefixes[j] for j in siblings}) == 1
        module = set_path(f"{name}.{attr}")
        start = sum(blocks[j][4][0] for j in siblings if j < i)  # the experts of sets before it
        if shared and offsets[i] != start:
            raise PackError(
                f"{where}: decoder layer {decoder_layer}'s experts set at {module} starts at "
                f"expert {start} of {prefixes[i]}, the pack's at {offsets[i]}"
            )
        if not shared and set_path(str(prefixes[i])) != module:
            raise PackError(
                f"{where}: decoder layer {decoder_layer}'s experts module {module} is the "
                f"pack's {set_path(str(prefixes[i]))} (a pack made from another layout?)"
            )


def load(
    path_or_repo: str | os.PathLike[str],
    *,
    arena_bytes: int | None = None,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    pack_path: str | os.PathLike[str] | None = None,
    config: StreamConfig | None = None,
    progress: bool = True,
    model_class: type[Any] | None = None,
    **from_pretrained_kwargs: Any,
) -> Any:
    """As ``AutoModelForCausalLM.from_pretrained(path_or_repo, dtype=dtype, **kwargs)``, with
    the routed experts streamed; returns the PreTrainedModel (the tokenizer stays AutoTokenizer's).
    A vision or omni model with no causal LM of its own loads as the class transformers builds
    for image-text-to-text (`generation_class`): its text decoder's experts stream, and it
    generates from text alone (no images).

    arena_bytes: expert memory (None: sized from the host memory available once the dense
    weights are loaded, leaving headroom for the KV cache and activations; too little is a
    ConfigError saying how much is needed; on CUDA sized from the GPU memory free after the dense
    weights, and host memory, since the GPU mirrors the host arena). device: "cpu" (default;
    the dense layers in torch on the CPU, the experts on the CPU backend) or "cuda" (the dense
    layers in torch on CUDA device 0, the experts on the cuda backend, reading x from and
    writing their output to torch's CUDA tensors). config: the
    StreamConfig (default: from the environment); arena_bytes wins over config.arena_bytes.
    pack_path: the pack of this model (default: converted on first load into
    strata_stream.paths.cache_dir(), with progress when `progress`).
    model_class: the class to build, for a checkpoint whose model is not a text generator (a
    text sub-config's AutoModel, a token-classification head): a transformers Auto class such
    as ``transformers.AutoModel`` (resolved for this config as the library resolves it) or a
    model class that takes this config (`model_class_for`). Default: `generation_class`. The
    same experts modules stream, from the same pack, in the same arena.
    The model works unchanged with generate (greedy and sampling), streamers and caches;
    `model.strata_engine` holds the engine (`.window.stats()`, `.close()`).
    """
    from transformers import AutoConfig

    dev = _device_arg(device)
    if from_pretrained_kwargs.get("device_map") not in (None, "cpu"):
        raise ConfigError(
            "device_map: not supported; pass device= (the dense layers go to that one device)"
        )
    kwargs = dict(from_pretrained_kwargs)
    kwargs.pop("device_map", None)
    if dev.type == "cuda":
        kwargs["device_map"] = {"": dev}  # the dense weights load straight onto the GPU
    # A repo's config, weights and tokenizer (the files `convert` and mlx-lm fetch too: one
    # snapshot, so one cached pack); its experts are converted from the shards on first load.
    model_path = model_dir(path_or_repo, kwargs.get("revision"))
    hf_config = AutoConfig.from_pretrained(
        model_path, trust_remote_code=kwargs.get("trust_remote_code", False)
    )
    if model_class is not None:
        base = model_class_for(hf_config, model_class, model_path)
    else:
        try:
            base = generation_class(hf_config, model_path)
        except ConfigError as e:
            raise ConfigError(
                f"{e}; to stream it as another of its classes, pass model_class= (e.g. "
                "transformers.AutoModel, or one of those classes)"
            ) from None
    hf_config = config_for(base, hf_config)
    quant = getattr(hf_config, "quantization_config", None)
    method = (
        quant.get("quant_method")
        if isinstance(quant, dict)
        else getattr(quant, "quant_method", None)
    )
    if str(getattr(method, "value", method)) == "mxfp4" and "quantization_config" not in kwargs:
        # mxfp4 quantizes the experts only, and they come from the pack: nothing is left for its
        # kernels (which need a GPU or the `kernels` package), so dequantize-on-load it is.
        from transformers.utils.quantization_config import Mxfp4Config

        kwargs["quantization_config"] = Mxfp4Config(dequantize=True)
    slot = EngineSlot()
    if dtype is not None:
        kwargs["dtype"] = dtype
    model = _streamed_class(base, slot).from_pretrained(model_path, config=hf_config, **kwargs)
    if not slot.blocks:
        raise ConfigError(f"{model_path}: the model has no sparse MoE blocks with routed experts")
    pack_file = ensure_pack(model_path, pack_path, progress=progress)
    with ExpertPack.open(pack_file) as pack:
        _check_pack(pack, slot.blocks)
        refs = [
            BlockRef(i, decoder_layer, block, family, attr, path=set_path(f"{name}.{attr}"))
            for i, (decoder_layer, name, block, family, _, attr) in enumerate(slot.blocks)
        ]
        base_cfg = config if config is not None else StreamConfig.from_env()
        dense = settle(model, base_cfg.max_rows)  # before sizing: the charge then holds it
        if dense.held_back and arena_bytes is None:
            raise ConfigError(_held_back_message(dense.held_back))
        arena = _arena_bytes(pack, arena_bytes, dev, dense.counted, dense.pending)
        cfg = base_cfg.replace(arena_bytes=arena)
        engine = TorchMoeEngine(pack, cfg, refs, dev)
    slot.engine = engine
    _hook_sets(model, slot.blocks, engine)
    object.__setattr__(model, "strata_dense", dense)
    object.__setattr__(model, "strata_engine", engine)
    object.__setattr__(model, "strata_pack_path", pack_file)
    object.__setattr__(model, "strata_model_dir", model_path)
    weakref.finalize(model, engine.close)
    return model


def describe(model: Any) -> dict[str, Any]:
    """The streaming engine's figures for a model `load` returned (Window.stats() and more)."""
    engine: TorchMoeEngine = model.strata_engine
    stats = engine.stats()
    stats["arena_bytes"] = engine.config.arena_bytes
    stats["n_slots"] = engine.stream.n_slots
    stats["device"] = str(engine.device)
    stats["backend"] = engine.window.backend
    stats.update(model.strata_dense.as_dict())  # in host memory; 0 with them on a GPU
    return stats


def stats_source(model: Any) -> Callable[[], Mapping[str, Any]]:
    """A snapshot function of the engine under a model `load` returned, in the schema the
    server's metrics read (strata_stream.engine_stats). Call it from the thread that generates."""
    from strata_stream.engine_stats import window_stats_source

    engine: TorchMoeEngine = model.strata_engine
    return window_stats_source(engine.window)


__all__ = ["describe", "load", "stats_source"]
