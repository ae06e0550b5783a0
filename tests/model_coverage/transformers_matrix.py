"""Coverage matrix: every experts-interface MoE model type of the installed transformers,
streamed through `strata_stream.transformers.load` vs plain transformers.

Discovery (no hand list): every model type of transformers' config table whose model package
uses ``use_experts_implementation`` (in its own modeling file, or a model package it imports
from) is a candidate, unless transformers builds no model for it by itself (a vision or audio
tower's sub-config: `has_a_model`); each candidate's generation class is built tiny from its
own config class (the class `strata_stream.transformers.loader.generation_class` resolves, as
the library does: the causal LM, else a vision model's image-text-to-text class; where it has
none, as a text sub-config or a classifier has, the class transformers maps for its config:
`output_class`), and the types whose built model holds an experts-interface module
(`families.is_experts_module`) are the rows. A candidate that fails to build tiny stays a row
saying why.

The tiny config (`tiny_config`) shrinks the config class's own defaults: `TINY` by field name,
never growing a default, keeping the relations the library's validators check (widths that
equal the hidden size, the query : key-value head ratio, rotary sections that sum to half the
rotary width), and meeting a validator's demand that names its value (`_demand`). Per-type
entries (`PATCHES`, `MODELING_SECTIONS`) are the last resort, each saying why.

Per type, in a subprocess with a timeout: a tiny random float32 checkpoint (`TINY`, keyed by
config field name; transformers' own classes and save_pretrained), then plain transformers
(eager attention, eager experts) against the streamed model on the same directory, at an arena
of 2 * top_k + 1 expert records (well below the experts' size): teacher-forced logits within
the float32 tolerance of tests/test_transformers_families.py (1e-5 of max|logit|) and greedy
tokens. A type with no generation class is streamed with ``load(..., model_class=<its Auto
class>)`` and compared on its model's output tensor alone (the head's logits, else
last_hidden_state), teacher-forced over the same sequence within the same tolerance: it has
no greedy tokens, and its row says what was compared. Results: ``exact``, ``exact (...)``,
``mismatch (...)``, ``refused: <one line>``, ``crash: <type: msg>``, ``skip: <reason>``.

    python -m tests.model_coverage.transformers_matrix [--types a,b] [--shard i/n] [--json OUT]
                                                 [--write-docs docs/models.md]
    python -m tests.model_coverage.transformers_matrix --rows shard0.json shard1.json ...
                                                 [--write-docs docs/models.md]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HIDDEN, INTER, EXPERTS, TOP_K, LAYERS = 64, 24, 8, 2, 3
# Tiny values by config field name, applied wherever a config class has the field (in its
# defaults), and to its text_config likewise. One dict for every type.
TINY: dict[str, Any] = {
    # widths and depth (2 * moe_intermediate != hidden: the two fused orientations differ)
    "hidden_size": HIDDEN,
    "text_hidden_size": HIDDEN,  # a vision tower's output width, fed to the text model
    "intermediate_size": 96,
    "moe_intermediate_size": INTER,
    "expert_intermediate_size": INTER,
    "moe_ffn_hidden_size": INTER,
    "shared_expert_intermediate_size": 48,
    "moe_shared_expert_intermediate_size": 48,
    "dense_intermediate_size": 96,
    "num_hidden_layers": LAYERS,
    "num_layers": LAYERS,
    "vocab_size": 64,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    # attention
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "kv_lora_rank": 32,
    "q_lora_rank": 32,
    # Multi-head latent attention (DeepSeek-style): head_dim is derived from these (_tiny).
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 32,
    "sliding_window": 8,
    "index_head_dim": 32,
    "index_n_heads": 2,
    "index_topk": 16,
    # a sparse-attention indexer whose fields have no defaults (all or none are set)
    "indexer_n_heads": 2,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 32,
    "indexer_budget": 16,
    "indexer_compress_ratio": 4,
    # linear attention / state-space layers
    "linear_num_value_heads": 2,
    "linear_num_key_heads": 1,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "mamba_n_heads": 2,
    "mamba_d_head": 64,  # heads x head width = the Mamba mixer's 2 x hidden_size
    "mamba_head_dim": 64,
    "mamba_d_state": 8,
    "ssm_state_size": 8,
    "n_groups": 1,
    "attn_layer_period": 2,  # Jamba-style period/offset layouts: attention in a 3-layer model
    "attn_layer_offset": 1,
    "mamba_n_groups": 1,
    # experts and routing
    "num_experts": EXPERTS,
    "num_local_experts": EXPERTS,
    "n_routed_experts": EXPERTS,
    "moe_num_experts": EXPERTS,
    "num_experts_per_tok": TOP_K,
    "top_k_experts": TOP_K,
    "enable_moe_block": True,
    "moe_topk": TOP_K,
    "moe_k": TOP_K,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "n_group": 2,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.5,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    # ids
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 0,
}
# TINY sizes set whatever the default (a relation, not a size: heads x head width of a Mamba
# mixer is 2 x hidden_size; the ids are the tiny vocabulary's).
KEEP_TINY = {"mamba_d_head", "mamba_head_dim", "bos_token_id", "eos_token_id", "pad_token_id"}
# Rotary sections (time, height, width) the modeling code holds as its defaults, where the
# config's defaults have none (read from modeling_<type>.py): scaled, as the config's own are,
# to the tiny rotary width (`_sections`). Keyed by the config class's model type.
MODELING_SECTIONS: dict[str, list[int]] = {
    "glm4v_moe_text": [8, 12, 12],
    "ernie4_5_vl_moe_text": [22, 22, 20],
}
# The last resort, per model type: entries its own default config lacks for plain transformers
# to run at all. granitemoehybrid: the default layer_types are all linear attention (real
# Granite 4 checkpoints interleave attention), and generate's mask needs one attention layer.
# qwen3_omni_moe_thinker: its model reads vision_start_token_id, which its config class does
# not declare (the talker's does; the released thinker configs carry it).
PATCHES: dict[str, dict[str, Any]] = {
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention", "linear_attention"]},
    "qwen3_omni_moe_thinker": {"vision_start_token_id": 151652},
}
# Set where the tiny config fails to build without them (a field with no default).
FALLBACK: dict[str, Any] = {
    "layer_types": ["full_attention"] * LAYERS,
    "mlp_layer_types": ["dense", "sparse", "sparse"],
}
# The float32 tolerance of tests/test_transformers_families.py: the same equations, accumulated
# in another order.
TOLERANCE = 1e-5
PROMPT = [5, 9, 12, 3, 40, 22, 7, 8, 9, 10, 33, 2, 17, 61, 4, 4, 30, 12, 50, 6]
NEW_TOKENS = 8
REGION = "matrix:transformers"
NO_EXPERTS = "the built model holds no experts-interface module"
NO_MODEL = "no model class"  # a candidate transformers builds nothing for (a tower sub-config)


def _transformers_dir() -> Path:
    import transformers

    return Path(transformers.__file__).parent / "models"


def _uses_experts_interface(package: str, seen: frozenset[str] = frozenset()) -> bool:
    """Whether a model package's modeling files use the experts interface, or import from a
    model package that does."""
    root = _transformers_dir() / package
    text = "".join(p.read_text(errors="replace") for p in sorted(root.glob("modeling_*.py")))
    if "use_experts_implementation" in text:
        return True
    for other in sorted(set(re.findall(r"from \.\.(\w+)\.modeling_", text)) - seen - {package}):
        if _uses_experts_interface(other, seen | {package}):
            return True
    return False


def candidates() -> list[str]:
    """Every model type whose model package uses the experts interface (source only)."""
    from transformers.models.auto.configuration_auto import (
        CONFIG_MAPPING_NAMES,
        model_type_to_module_name,
    )

    out = []
    for model_type in sorted(CONFIG_MAPPING_NAMES):
        package = model_type_to_module_name(model_type)
        if (_transformers_dir() / package).is_dir() and _uses_experts_interface(package):
            out.append(model_type)
    return out


def has_a_model(model_type: str) -> bool:
    """Whether transformers builds a model for `model_type` by itself: a class one of its Auto
    classes maps (`output_class`) or a generation class. A candidate with neither (a vision or
    audio tower's sub-config) is no row, and this says so without building it."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from strata_stream.errors import ConfigError
    from strata_stream.transformers.loader import generation_class

    config_class = CONFIG_MAPPING[model_type]
    if output_class(config_class) is not None:
        return True
    try:
        generation_class(config_class())
    except ConfigError:
        return False
    except Exception:  # noqa: BLE001 - a config that needs arguments: let the row say
        return True
    return True


def output_class(config_class: Any) -> Any | None:
    """The Auto class a model with no generation class is built with, as a user would load it:
    the one task head transformers maps for `config_class` (an ``AutoModelFor<Task>``: the
    privacy filter's token classification), else AutoModel where its table maps it (a text
    sub-config's text model); None where transformers maps none. Where several heads map it,
    AutoModel: the output they all share."""
    import transformers
    from transformers.models.auto.auto_factory import _BaseAutoModelClass

    autos = [getattr(transformers, n) for n in dir(transformers) if n.startswith("AutoModel")]
    mapped = [
        a
        for a in autos
        if isinstance(a, type)
        and issubclass(a, _BaseAutoModelClass)
        and config_class in a._model_mapping  # noqa: SLF001 - its class table
    ]
    heads = [a for a in mapped if a is not transformers.AutoModel]
    if len(heads) == 1:
        return heads[0]
    return transformers.AutoModel if transformers.AutoModel in mapped else None


def _window(values: list[Any]) -> list[Any]:
    """LAYERS consecutive entries of a per-layer list, the first window with the most distinct
    values (so a pattern such as three linear-attention layers then a full one keeps both)."""
    windows = [values[i : i + LAYERS] for i in range(len(values) - LAYERS + 1)]
    return max(windows, key=lambda w: len({json.dumps(v) for v in w}))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _scaled(values: list[int], total: int) -> list[int]:
    """`values` scaled to sum to `total`, entries that were equal kept equal (sections a model
    stacks, as height and width, must be), every entry at least 1 where `total` allows."""
    whole = sum(values)
    exact = [v * total / whole for v in values]
    out = [int(x) for x in exact]
    groups: dict[int, list[int]] = {}
    for i, v in enumerate(values):
        groups.setdefault(v, []).append(i)
    # the remainder goes to whole groups of equal entries, the largest fractions first
    for v in sorted(groups, key=lambda v: int(exact[groups[v][0]]) - exact[groups[v][0]]):
        if sum(out) + len(groups[v]) <= total:
            for i in groups[v]:
                out[i] += 1
    for i in range(len(out)):  # what no whole group could take, one entry at a time
        if sum(out) < total:
            out[i] += 1
    while 0 in out and max(out) > 1:  # an empty section would drop an axis
        out[out.index(0)] += 1
        out[out.index(max(out))] -= 1
    return out


def _sections(defaults: dict[str, Any], kwargs: dict[str, Any], model_type: str) -> None:
    """Rotary sections (``mrope_section``: time, height and width) sum to a fixed fraction of a
    head dimension: the defaults' fraction kept for the tiny dimension, in place. Sections the
    modeling code holds (MODELING_SECTIONS) are scaled to half the tiny rotary width."""
    rope = copy.deepcopy(defaults.get("rope_parameters"))  # the defaults stay as they were
    if not isinstance(rope, dict):
        return
    if model_type in MODELING_SECTIONS and not any("section" in k for k in rope):
        width = kwargs.get("head_dim") or kwargs["hidden_size"] // kwargs["num_attention_heads"]
        rotary = int(width * float(rope.get("partial_rotary_factor", 1.0)))
        kwargs["rope_parameters"] = {
            **rope, "mrope_section": _scaled(MODELING_SECTIONS[model_type], rotary // 2)
        }  # fmt: skip
        return
    nested = [v for v in rope.values() if isinstance(v, dict)]
    holders = nested or [rope]
    dims = [f for f in ("qk_rope_head_dim", "head_dim") if _is_int(defaults.get(f))]
    changed = False
    for holder in holders:
        for key, value in list(holder.items()):
            if "section" not in key or not isinstance(value, list) or not value:
                continue
            if not all(_is_int(v) and v > 0 for v in value):
                continue
            for f in dims:
                ratio = defaults[f] / sum(value)
                tiny = kwargs.get(f, defaults[f])
                if ratio in (1, 2, 4) and _is_int(tiny) and tiny % ratio == 0:
                    holder[key] = _scaled(value, int(tiny // ratio))
                    changed = True
                    break
    if changed:
        kwargs["rope_parameters"] = rope


def _head_relations(defaults: dict[str, Any], kwargs: dict[str, Any]) -> None:
    """Head shapes as the defaults relate them, in place: the query : key-value head ratio (a
    sliding layer may double its key-value heads), and under latent attention a head width
    that equals the rotary part, the query's nope + rope or the value's stays so (else it is
    derived from the split and left out)."""
    heads, kv = defaults.get("num_attention_heads"), defaults.get("num_key_value_heads")
    if _is_int(heads) and _is_int(kv) and heads > 0 and "num_key_value_heads" in kwargs:
        tiny_heads = kwargs.get("num_attention_heads", heads)
        kwargs["num_key_value_heads"] = max(1, tiny_heads * kv // heads)
    if "qk_rope_head_dim" not in defaults:
        return
    parts = ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
    tiny = {f: kwargs.get(f, defaults.get(f)) for f in parts}
    if not all(_is_int(defaults.get(f)) and _is_int(tiny[f]) for f in parts):
        return
    same = {
        defaults["qk_rope_head_dim"] + defaults["qk_nope_head_dim"]:
            tiny["qk_rope_head_dim"] + tiny["qk_nope_head_dim"],
        defaults["v_head_dim"]: tiny["v_head_dim"],
        defaults["qk_rope_head_dim"]: tiny["qk_rope_head_dim"],
    }  # fmt: skip
    for f in ("head_dim", "qk_head_dim"):
        d = defaults.get(f)
        if _is_int(d) and d in same and d != 0:
            kwargs[f] = same[d]
        else:
            kwargs.pop(f, None)


def _tiny(config_class: Any, extra: dict[str, Any] | None = None,
          related: dict[int, int] | None = None) -> dict[str, Any]:  # fmt: skip
    """Tiny entries for the fields `config_class` has, shrunk from its own defaults so the
    relations its validators check keep holding:

    - TINY's entries by name, or by the name the config's attribute_map gives it;
    - TINY's sizes replace a default only where smaller (a type that demands top-1 keeps it),
      and a size whose default is 0 stays 0 (0 means "none": NoPE, no shared experts);
    - a width whose default equals a default hidden size (`related`: this config's and, for a
      vision or audio tower, the text model's) is the tiny hidden size (an adapter's input, a
      projector's output);
    - other head counts at most the tiny attention's, other vocabulary sizes the tiny
      vocabulary (an unpadded vocabulary is at most the padded one);
    - per-layer lists are cut to LAYERS, rotary sections scaled with their head dimension.
    """
    defaults = config_class().to_dict()
    related = {**(related or {})}
    if _is_int(defaults.get("hidden_size")) and defaults["hidden_size"] >= 256:
        related[defaults["hidden_size"]] = HIDDEN
    kwargs: dict[str, Any] = {}
    # TINY's names, or the config's own for them (attribute_map: n_group -> num_expert_group)
    aliases = getattr(config_class, "attribute_map", None) or {}
    for name, v in TINY.items():
        k = name if name in defaults else aliases.get(name, name)
        if k not in defaults or k in kwargs:
            continue
        d = defaults[k]
        if _is_int(v) and _is_int(d) and name not in KEEP_TINY:
            if d == 0:
                continue
            v = min(v, d)
        kwargs[k] = v
    for k, v in kwargs.items():  # a per-layer (or per-modality) list of a scalar field: all v
        if isinstance(defaults[k], list) and not isinstance(v, list) and defaults[k]:
            kwargs[k] = [v] * len(defaults[k])
    _head_relations(defaults, kwargs)
    for k, d in defaults.items():
        if k in kwargs or not _is_int(d):
            continue
        if d in related and any(w in k for w in ("dim", "size", "hidden")):
            kwargs[k] = related[d]
        elif k.endswith("heads") and d > TINY["num_attention_heads"]:
            kwargs[k] = TINY["num_attention_heads"]
        elif k.endswith("vocab_size") and d > TINY["vocab_size"]:
            kwargs[k] = TINY["vocab_size"]
    n = defaults.get("num_hidden_layers")
    for k, v in defaults.items():
        if k not in kwargs and isinstance(v, list) and n and len(v) == n and n > LAYERS:
            kwargs[k] = _window(v)
    _sections(defaults, kwargs, str(getattr(config_class, "model_type", "")))
    return {**kwargs, **{k: v for k, v in (extra or {}).items() if k in defaults}}


# A validator's demand, where it names what it wants: "`a.b` (2304) must match `c.d` (64)",
# "adapter_in_dim must match hidden_size", "`x` must be between 1 and ..." (its lower bound).
_MUST_MATCH = re.compile(
    r"`?(?P<a>[\w.]+)`? (?:\((?P<x>-?\d+)\) )?must (?:match|equal) `?(?P<b>[\w.]+)`?"
    r"(?: \((?P<y>-?\d+)\))?"
    r"|`?(?P<a2>[\w.]+)`? must be between (?P<low>-?\d+) and"
)


def _demand(message: str, kwargs: dict[str, Any], config_class: Any) -> bool:
    """Set in `kwargs` what a validator's `message` demands, where it says so generically (one
    field must match another); whether anything was set."""
    m = _MUST_MATCH.search(message)
    if m is None:
        return False
    target = (m.group("a") or m.group("a2")).split(".")
    value: Any = next((int(m.group(g)) for g in ("y", "low") if m.group(g) is not None), None)
    subs = _sub_configs(config_class)
    # where the field lives: the named sub-config, else this config or the first sub-config
    # whose defaults hold it
    if len(target) == 1:
        holders = [None, *subs]
        for h in holders:
            fields = config_class().to_dict() if h is None else _defaults(subs[h])
            if target[0] in fields:
                target = [target[0]] if h is None else [h, target[0]]
                if value is None:
                    other = m.group("b").split(".")[-1]
                    level = kwargs if h is None else kwargs.get(h, {})
                    value = level.get(other, fields.get(other))
                break
    if value is None or len(target) > 2:
        return False
    if len(target) == 2:
        level = kwargs.setdefault(target[0], {})
        if not isinstance(level, dict) or level.get(target[1]) == value:
            return False
        level[target[1]] = value
    else:
        if kwargs.get(target[0]) == value:
            return False
        kwargs[target[0]] = value
    return True


def _defaults(config_class: Any) -> dict[str, Any]:
    try:
        return dict(config_class().to_dict())
    except Exception:  # noqa: BLE001 - a config that needs arguments has no defaults to read
        return {}


def _sub_configs(config_class: Any) -> dict[str, Any]:
    """A config class's sub-config classes (``sub_configs``, or ``sub_configs_defaults``); one
    given as AutoConfig (the tower is whatever model type the default names) is the class of
    the default's."""
    from transformers import AutoConfig

    subs = dict(
        getattr(config_class, "sub_configs", None)
        or getattr(config_class, "sub_configs_defaults", None)
        or {}
    )
    for name, sub in subs.items():
        if sub is AutoConfig:
            try:
                subs[name] = type(getattr(config_class(), name))
            except Exception:  # noqa: BLE001, S112 - no default to read: it keeps its own
                continue
    return subs


def _sub_kwargs(sub_class: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A sub-config's entries as its parent takes them (with its model_type, which an
    AutoConfig-typed sub-config is resolved by)."""
    model_type = getattr(sub_class, "model_type", "")
    return {"model_type": model_type, **kwargs} if model_type else kwargs


def _tiny_tree(config_class: Any, extra: dict[str, Any] | None,
               related: dict[int, int]) -> dict[str, Any]:  # fmt: skip
    """`_tiny` of a sub-config, its own sub-configs (a vision tower's encoders) tiny alike."""
    kwargs = _tiny(config_class, extra, related)
    for name, sub_class in _sub_configs(config_class).items():
        try:
            kwargs[name] = _sub_kwargs(sub_class, _tiny_tree(sub_class, None, related))
        except Exception:  # noqa: BLE001, S112 - a sub-config that needs arguments keeps its own
            continue
    return kwargs


def tiny_config(model_type: str, extra: dict[str, Any] | None = None) -> Any:
    """The tiny config of `model_type`, built by its own config class (`extra`: entries set
    whatever the defaults hold); a validator's error that names the value it demands is met
    (`_demand`) and the build tried again."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    kwargs = {**_tiny(config_class, extra), **PATCHES.get(model_type, {})}
    sub = _sub_configs(config_class)
    text = sub.get("text_config")
    text_hidden = _defaults(text).get("hidden_size") if text is not None else None
    related = {text_hidden: HIDDEN} if _is_int(text_hidden) and text_hidden >= 256 else {}
    for name, sub_class in sub.items():  # text_config, vision_config, ...: tiny alike
        try:
            tiny = _tiny_tree(sub_class, extra if name == "text_config" else None, related)
            kwargs[name] = _sub_kwargs(sub_class, tiny)
        except Exception:  # noqa: BLE001, S112 - a sub-config that needs arguments keeps its own
            continue
    for _ in range(4):
        try:
            return config_class(**kwargs)
        except Exception as e:
            if not _demand(str(e), kwargs, config_class):
                raise
    return config_class(**kwargs)


def _one_line(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    return msg if len(msg) <= 300 else msg[:297] + "..."


@dataclass
class Row:
    model_type: str
    result: str  # exact | mismatch (...) | refused: ... | crash: ... | skip: ...
    seconds: float = 0.0
    prediction: str = ""  # "router 2/2" etc. where the streamed model loaded

    @property
    def exact(self) -> bool:
        """Every comparison the row makes passed (``exact (...)``: which ones, where they are
        not the logits and greedy tokens of a generation class)."""
        return self.result == "exact" or self.result.startswith("exact (")


@dataclass
class Built:
    """A tiny checkpoint's model: the class built (`cls`), the Auto class it was resolved from
    where the type has no generation class (`auto`: passed to load as model_class), and
    whether the model holds experts-interface modules (`moe`)."""

    cls: type[Any]
    auto: Any | None
    moe: bool


def _model_class(config: Any) -> tuple[type[Any], Any | None]:
    """The class a row builds for `config`: its generation class (`generation_class`), else
    the class `output_class` maps, resolved as load resolves it (`model_class_for`), with that
    Auto class. ConfigError where transformers builds neither."""
    from strata_stream.errors import ConfigError
    from strata_stream.transformers.loader import generation_class, model_class_for

    try:
        return generation_class(config), None
    except ConfigError:
        pass
    auto = output_class(type(config))
    if auto is None:
        raise ConfigError(f"{NO_MODEL} for {type(config).__name__}")
    return model_class_for(config, auto), auto


def build_tiny(model_type: str, path: Path) -> Built:
    """A tiny random float32 checkpoint of `model_type` at `path`, of the class `_model_class`
    finds. Raises on a failed build (ConfigError where transformers maps no model class)."""
    import torch

    from strata_stream.transformers.families import find_blocks
    from strata_stream.transformers.loader import config_for
    from strata_stream.transformers.random_model import randomize

    try:
        config = tiny_config(model_type)
        built, _ = _model_class(config)
        with torch.device("meta"):  # does it build? (structure only)
            built._from_config(config_for(built, config))
    except Exception as e:  # noqa: BLE001 - once more with the entries no default provides
        try:
            config = tiny_config(model_type, FALLBACK)
        except Exception:  # noqa: BLE001 - the first failure is the one to report
            raise e from None
    cls, auto = _model_class(config)
    torch.manual_seed(0)
    model = cls._from_config(config_for(cls, config), dtype=torch.float32)
    if not find_blocks(model):
        return Built(cls, auto, False)
    randomize(model, 0)
    model.config.dtype = "float32"
    model.save_pretrained(str(path))
    return Built(cls, auto, True)


def _output(out: Any) -> tuple[str, Any]:
    """The output tensor a row compares for a model with no generation class: the head's
    logits, else the base model's last_hidden_state (name, [T, ...] float32 array)."""
    logits = getattr(out, "logits", None)
    name, t = ("logits", logits) if logits is not None else ("last_hidden_state", out[0])
    return name, t[0].float().numpy()


def run_type_here(model_type: str, root: Path) -> Row:
    """One row, in this process."""
    import numpy as np
    import torch

    from strata_stream import ExpertPack, StreamConfig
    from strata_stream.convert import convert
    from strata_stream.errors import ConfigError, PackError, StrataError
    from strata_stream.transformers import load

    start = time.monotonic()
    path = root / model_type

    def row(result: str, prediction: str = "") -> Row:
        return Row(model_type, result, round(time.monotonic() - start, 1), prediction)

    try:
        built = build_tiny(model_type, path)
    except ConfigError as e:
        return row(f"skip: {_one_line(e)}")
    except Exception as e:  # noqa: BLE001 - plain transformers itself fails
        return row(f"skip: plain transformers fails to build tiny ({type(e).__name__}: "
                   f"{_one_line(e)})")  # fmt: skip
    if not built.moe:
        return row(f"skip: {NO_EXPERTS}")
    generates = built.auto is None

    def run(model: Any) -> tuple[str, Any, list[int]]:
        """(what was compared, its teacher-forced [T, ...] array, greedy tokens or [])."""
        with torch.no_grad():
            out = model(torch.tensor([PROMPT]))
        if not generates:
            return (*_output(out), [])
        toks = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False)
        return "logits", out.logits[0].float().numpy(), [int(t) for t in toks[0, len(PROMPT) :]]

    try:
        ref_model = built.cls.from_pretrained(
            str(path), dtype=torch.float32, attn_implementation="eager",
            experts_implementation="eager",
        ).eval()  # fmt: skip
        ref = run(ref_model)
        del ref_model
    except Exception as e:  # noqa: BLE001
        return row(f"skip: plain transformers fails to run tiny ({type(e).__name__}: "
                   f"{_one_line(e)})")  # fmt: skip
    config = StreamConfig(io_threads=2, direct_io=False, persist_profile=False)
    model = None
    try:
        pack = root / f"{model_type}.strpk"
        try:
            convert(path, pack, progress=False)
        except (ConfigError, PackError):
            # What load says first: its own refusal of the model, else the converter's.
            load(path, pack_path=pack, config=config, progress=False, model_class=built.auto)
            raise
        with ExpertPack.open(pack) as p:
            arena = (2 * p.geometry.top_k + 1) * p.record_stride
        model = load(
            path, pack_path=pack, arena_bytes=arena, config=config, dtype=torch.float32,
            attn_implementation="eager", progress=False, model_class=built.auto,
        )  # fmt: skip
        if not isinstance(model, built.cls):  # load resolved the Auto class as the row did
            return row(f"crash: load built {type(model).__mro__[1].__name__}, not "
                       f"{built.cls.__name__}")  # fmt: skip
        engine = model.strata_engine
        prediction = f"router {engine.prediction.count('router')}/{len(engine.prediction)}"
        got = run(model)
    except (ConfigError, PackError) as e:  # the temporary directory's name says nothing
        return row(f"refused: {_one_line(e).replace(str(path), '<checkpoint>')}")
    except StrataError as e:
        return row(f"crash: {type(e).__name__}: {_one_line(e)}")
    except Exception as e:  # noqa: BLE001
        return row(f"crash: {type(e).__name__}: {_one_line(e)}")
    finally:
        if model is not None:
            model.strata_engine.close()
    name, ref_out, ref_tokens = ref
    _, got_out, got_tokens = got
    scale = float(np.abs(ref_out).max())
    diff = float(np.abs(got_out - ref_out).max())
    if not np.isfinite(diff) or diff > TOLERANCE * scale:
        return row(f"mismatch ({name}: max|diff| {diff:.3g} of max|{name}| {scale:.3g})",
                   prediction)  # fmt: skip
    if got_tokens != ref_tokens:
        return row(f"mismatch (greedy tokens {got_tokens} vs {ref_tokens})", prediction)
    if not generates:
        return row(f"exact ({compared(built, name)})", prediction)
    return row("exact", prediction)


def compared(built: Built, name: str) -> str:
    """What a row with no generation class compared: `name` of the class its Auto class
    builds, teacher-forced, and no greedy tokens."""
    return (
        f"no generation class: {built.auto.__name__}'s {built.cls.__name__} {name} "
        "teacher-forced, no greedy tokens"
    )


def run_type(model_type: str, timeout: float) -> Row:
    """One row, in a subprocess with a timeout."""
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"tfm-{model_type}-") as tmp:
        out = Path(tmp) / "row.json"
        argv = [sys.executable, "-m", "tests.model_coverage.transformers_matrix", "--child",
                model_type, "--json", str(out), "--workdir", tmp]  # fmt: skip
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
        try:
            proc = subprocess.run(
                argv, capture_output=True, text=True, timeout=timeout, env=env,
                cwd=Path(__file__).resolve().parents[2],
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return Row(model_type, f"crash: timeout after {timeout:.0f} s", round(timeout, 1))
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            why = _one_line(Exception(tail))
            return Row(model_type, f"crash: child exited {proc.returncode}: {why}",
                       round(time.monotonic() - start, 1))  # fmt: skip
        data = json.loads(out.read_text())
        return Row(**data)


def closing_line(rows: list[Row]) -> str:
    """`transformers X.Y.Z: N of M MoE model types stream exactly` (M: every row, skipped ones
    included, as the mlx-lm matrix counts; N: the rows whose comparisons all pass), then how
    many of those that build and run tiny in plain transformers stream exactly, and how many of
    the exact rows have no generation class (compared on their model's output alone)."""
    import transformers

    ran = [r for r in rows if not r.result.startswith("skip")]
    exact = sum(r.exact for r in rows)
    no_generation = sum(r.result.startswith("exact (no generation class") for r in rows)
    return (
        f"transformers {transformers.__version__}: {exact} of {len(rows)} MoE model types stream "
        f"exactly ({exact} of the {len(ran)} that build and run tiny in plain transformers; "
        f"{no_generation} of them have no generation class and are compared on their model's "
        "output alone)"
    )


def table(rows: list[Row]) -> str:
    import transformers

    lines = [
        f"transformers {transformers.__version__}, generated by `python -m "
        "tests.model_coverage.transformers_matrix --write-docs docs/models.md`: every model type "
        "whose model uses transformers' experts interface, a tiny random float32 checkpoint "
        "streamed at an arena of 2 x top-k + 1 expert records against plain transformers "
        f"(teacher-forced logits within {TOLERANCE:g} of max|logit|, {NEW_TOKENS} greedy tokens; "
        "a type with no generation class: its model's output tensor, teacher-forced, within "
        f"{TOLERANCE:g} of its max|value|).",
        "",
        "| model type | result |",
        "|---|---|",
    ]
    for r in rows:
        cell = r.result.replace("|", "/").replace("<", "&lt;").replace(">", "&gt;")
        lines.append(f"| {r.model_type} | {cell} |")
    lines += ["", closing_line(rows)]
    return "\n".join(lines)


def write_docs(path: Path, rows: list[Row]) -> None:
    """Replace the region between the matrix:transformers markers of `path` with the table."""
    text = path.read_text()
    begin, end = f"<!-- {REGION} -->", f"<!-- /{REGION} -->"
    if begin not in text or end not in text:
        raise SystemExit(f"{path}: no {begin} ... {end} region")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{begin}\n{table(rows)}\n{end}{tail}")


def _line(row: Row) -> str:
    """One printed row: the result, the prediction where the streamed model loaded, the time."""
    pred = f" [prediction: {row.prediction}]" if row.prediction else ""
    return f"{row.model_type}: {row.result}{pred} ({row.seconds:.0f} s)"


def _is_moe_row(row: Row) -> bool:
    """Rows of MoE model types: not the candidates whose built model holds no experts module,
    nor the sub-configs (a vision or audio encoder's) that have no model class of their own."""
    return not row.result.startswith((f"skip: {NO_EXPERTS}", f"skip: {NO_MODEL} for"))


def shard_of(items: list[str], shard: str) -> list[str]:
    i, n = (int(v) for v in shard.split("/"))
    if not 0 <= i < n:
        raise SystemExit(f"--shard {shard}: i must be in 0..n-1")
    return items[i::n]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.model_coverage.transformers_matrix",
        description="Stream every experts-interface MoE model type of the installed "
        "transformers and compare with plain transformers.",
    )
    parser.add_argument("--types", help="comma-separated model types (default: every candidate)")
    parser.add_argument("--shard", help="i/n: every n-th type from the i-th (0-based)")
    parser.add_argument("--json", type=Path, help="write the rows as JSON here")
    parser.add_argument("--write-docs", type=Path, help="regenerate the matrix region of this file")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per model type")
    parser.add_argument("--jobs", type=int, default=1, help="model types run at once")
    parser.add_argument(
        "--rows",
        type=Path,
        nargs="+",
        help="render the rows of earlier --json runs (shards: one file each; a type in a later "
        "file replaces its row in an earlier one)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        import resource

        # A tiny model needs little memory; a config that stays huge must not take the machine.
        limit = int(float(os.environ.get("STRATA_MATRIX_MEMORY_GB", "8")) * (1 << 30))
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        row = run_type_here(args.child, args.workdir or Path(tempfile.mkdtemp()))
        if args.json:
            args.json.write_text(json.dumps(asdict(row)))
        return 0
    if args.rows:
        # shards in any order; a type run again in a later file replaces its earlier row
        by_type = {r["model_type"]: Row(**r) for f in args.rows for r in json.loads(f.read_text())}
        rows = [by_type[t] for t in sorted(by_type)]
        for r in rows:
            print(_line(r))
        print(closing_line([r for r in rows if _is_moe_row(r)]))
        if args.write_docs:
            write_docs(args.write_docs, [r for r in rows if _is_moe_row(r)])
        return 0
    types = args.types.split(",") if args.types else candidates()
    towers = [t for t in types if not has_a_model(t)]
    if towers:
        print(f"(no model of their own, so no rows: {', '.join(towers)})", flush=True)
    types = [t for t in types if t not in towers]
    if args.shard:
        types = shard_of(types, args.shard)
    start = time.monotonic()
    rows: list[Row] = []
    if args.jobs > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(args.jobs) as pool:
            for r in pool.map(lambda t: run_type(t, args.timeout), types):
                print(_line(r), flush=True)
                rows.append(r)
    else:
        for t in types:
            r = run_type(t, args.timeout)
            print(_line(r), flush=True)
            rows.append(r)
    rows = [r for r in rows if _is_moe_row(r)]
    print(f"({len(types)} candidate types in {time.monotonic() - start:.0f} s)")
    print(closing_line(rows))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    if args.write_docs:
        write_docs(args.write_docs, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
