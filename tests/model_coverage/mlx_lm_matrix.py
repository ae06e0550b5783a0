"""Coverage matrix: every MoE model type the installed mlx-lm ships, streamed vs plain mlx-lm.

Discovery (no hand list): each module of `mlx_lm.models` that defines `Model` and `ModelArgs`
is built from a tiny config generated from its own `ModelArgs` fields (`TINY`, keyed by field
name); the types whose built model holds a `SwitchGLU` or `SwitchMLP` (isinstance against
`mlx_lm.models.switch_layers`) are the MoE types. A module that fails to build tiny but whose
source (or a model module it imports) uses those classes is kept too, as a row that says why.

Per type, in a subprocess with a timeout: a tiny random checkpoint built with mlx-lm's own
classes and save utilities (q4 group 64 with the model's own quant predicate, as
`mlx_lm.convert -q` does, and a float32 unquantized one), then plain `mlx_lm.load` against
`strata_stream.mlx_lm.load(..., experts="cpu" | "mlx")` at an arena well below the experts'
size: teacher-forced logits (bitwise) and greedy tokens.

    python -m tests.model_coverage.mlx_lm_matrix [--types a,b] [--shard i/n] [--json OUT]
                                           [--write-docs docs/models.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import json
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Tiny values by ModelArgs field name, applied wherever a model type's ModelArgs has the field
# (its default or not): small dims, 8 experts, top-k 2, 3 layers (the first dense where a
# family has dense leading layers, so both kinds of layer run). One dict for every type.
HIDDEN, INTER, EXPERTS, TOP_K, LAYERS = 64, 64, 8, 2, 3
# Attention kinds by layer, in the vocabulary most families share; both kinds present.
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
TINY: dict[str, Any] = {
    # widths and depth
    "hidden_size": HIDDEN,
    "model_dim": HIDDEN,  # phixtral's names
    "num_heads": 2,
    "num_vocab": 64,
    "intermediate_size": 128,
    "ffn_hidden_size": 128,
    "intermediate_size_mlp": 128,
    "dense_intermediate_size": 128,
    "moe_intermediate_size": INTER,
    "moe_hidden_size": INTER,
    "expert_ffn_hidden_size": INTER,
    "shared_expert_intermediate_size": INTER,
    "shared_intermediate_size": INTER,
    "moe_shared_expert_intermediate_size": INTER,
    "share_expert_dim": INTER,
    "num_hidden_layers": LAYERS,
    "num_layers": LAYERS,
    "vocab_size": 64,
    "vocab_size_per_layer_input": 64,
    "hidden_size_per_layer_input": 16,
    "max_position_embeddings": 512,
    "model_max_length": 512,
    "tie_word_embeddings": False,
    "use_bias": False,
    "mlp_bias": False,
    # attention
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "num_attention_groups": 1,
    "head_dim": 32,
    "global_head_dim": 32,
    "rotary_dim": 16,
    "attention_bias": False,
    "rope_theta": 10000.0,
    "partial_rotary_factor": 1.0,
    "rms_norm_eps": 1e-5,
    "norm_eps": 1e-5,
    "post_norm_eps": 1e-5,
    "layer_norm_epsilon": 1e-5,
    "layernorm_epsilon": 1e-5,
    "use_qk_norm": True,
    "layer_types": LAYER_TYPES,
    "sliding_window": 8,
    "sliding_window_size": 8,
    "sliding_window_pattern": 2,
    "attention_chunk_size": 8,
    "num_kv_shared_layers": 0,
    "layer_rope_theta": [10000.0] * LAYERS,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "rope_scaling": None,
    "final_logit_softcapping": 30.0,
    "output_multiplier": 1.0,
    "logits_scaling": 1.0,
    "attention_multiplier": 0.25,
    "embedding_multiplier": 1.0,
    "residual_multiplier": 1.0,
    # multi-head latent attention
    "kv_lora_rank": 32,
    "index_head_dim": 32,  # DeepSeek sparse attention's indexer
    "index_n_heads": 2,
    "index_topk": 4,
    "q_lora_rank": 32,
    "o_groups": 1,  # grouped output projection (deepseek_v41): 64 wide, so q4 quantizes it
    "o_lora_rank": 64,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 32,
    "attention_method": "MLA",
    "mla_scale_q_lora": True,
    "mla_scale_kv_lora": True,
    # sliding-window attention of hybrid-attention families
    "add_swa_attention_sink_bias": True,
    "add_full_attention_sink_bias": False,
    "swa_rope_theta": 10000.0,
    "swa_num_attention_heads": 2,
    "swa_num_key_value_heads": 1,
    "swa_head_dim": 32,
    "swa_v_head_dim": 32,
    "hybrid_layer_pattern": [1, 0, 1],
    # linear attention / state-space layers of hybrid families
    "linear_num_value_heads": 2,
    "linear_num_key_heads": 1,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 2,
    "linear_attn_config": {
        "kda_layers": [1, 3],
        "full_attn_layers": [2],
        "head_dim": 16,
        "num_heads": 2,
        "short_conv_kernel_size": 4,
    },
    "layer_group_size": 2,
    "group_norm_size": 1,
    "attn_layer_offset": 1,
    "attn_layer_period": 2,
    "expert_layer_offset": 0,
    "expert_layer_period": 1,
    "mamba_d_conv": 4,
    "mamba_d_state": 16,
    "mamba_expand": 2,
    "mamba_num_heads": 8,  # x mamba_head_dim = mamba_expand x hidden_size (checked by transformers)
    "mamba_n_heads": 8,
    "mamba_head_dim": 16,
    "mamba_d_head": 16,
    "mamba_n_groups": 1,
    "mamba_proj_bias": False,
    "mamba_conv_bias": True,
    "ssm_state_size": 16,
    "conv_kernel": 4,
    "n_groups": 1,
    "use_conv_bias": True,
    "conv_bias": False,
    "conv_L_cache": 3,
    "use_cla": False,
    "cla_share_factor": 1,
    # experts and routing
    "num_experts": EXPERTS,
    "n_routed_experts": EXPERTS,
    "num_local_experts": EXPERTS,
    "moe_num_experts": EXPERTS,
    "num_experts_per_tok": TOP_K,
    "num_experts_per_token": TOP_K,
    "top_k_experts": TOP_K,
    "moe_topk": TOP_K,
    "moe_top_k": TOP_K,
    "moe_k": TOP_K,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "num_shared_expert": 1,
    "moe_num_shared_experts": 1,
    "n_group": 2,
    "num_expert_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "first_k_dense_replace": 1,
    "interleave_moe_layer_step": 1,
    "num_dense_layers": 1,
    "moe_layer_start_index": 1,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "is_moe_layer": [False, True, True],
    "enable_moe_block": True,
    "use_mixed_mlp_moe": True,
    "use_expert_bias": True,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "zero_expert_type": "identity",
    "zero_expert_num": 2,
}

# Fields that choose behaviour rather than size (routing and scoring functions, biases, norms,
# rope): a family's own default wins, TINY fills them only where ModelArgs requires a value.
BEHAVIOUR = frozenset(
    {
        "tie_word_embeddings", "use_bias", "mlp_bias", "attention_bias", "rope_theta",
        "rope_scaling", "rope_parameters", "partial_rotary_factor", "rms_norm_eps", "norm_eps",
        "post_norm_eps", "layer_norm_epsilon", "layernorm_epsilon", "use_qk_norm",
        "final_logit_softcapping", "output_multiplier", "logits_scaling",
        "attention_multiplier", "embedding_multiplier", "residual_multiplier",
        "mla_scale_q_lora", "mla_scale_kv_lora", "add_swa_attention_sink_bias",
        "add_full_attention_sink_bias", "swa_rope_theta", "mamba_proj_bias", "mamba_conv_bias",
        "use_conv_bias", "conv_bias", "use_cla", "cla_share_factor", "routed_scaling_factor",
        "norm_topk_prob", "use_expert_bias", "topk_method", "scoring_func", "zero_expert_type",
        "zero_expert_num", "attention_method", "moe_layer_start_index",
    }
)  # fmt: skip

# What one shared value cannot say: a field whose meaning (or type) differs by family, and
# the text model a multimodal wrapper builds.
# mistral4's attention scale reads these (its published configs carry them)
_MISTRAL4_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "llama_4_scaling_beta": 0.1,
                  "original_max_position_embeddings": 512}  # fmt: skip
_YARN = {
    "type": "yarn",
    "factor": 1.0,
    "original_max_position_embeddings": 512,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
OVERRIDES: dict[str, dict[str, Any]] = {
    "deepseek_v2": {"rope_scaling": _YARN},  # its attention reads the yarn parameters
    "hunyuan": {"rope_scaling": {"type": "dynamic", "factor": 1.0, "alpha": 1.0}},
    # refuses shared experts; transformers checks the audio encoder's width against the text's
    "muse_spark": {
        "text_config": {"num_shared_experts": 0},
        "audio_config": {"out_hidden_size": HIDDEN},
    },
    # routes top-1 only; every 4th layer is global attention, and the model reads the 4th cache
    "llama4": {
        "text_config": {
            "num_experts_per_tok": 1,
            "num_hidden_layers": 4,
            "layer_types": ["chunked_attention"] * 3 + ["full_attention"],
        }
    },
    # layers named by block kind: mamba, MoE, attention, MoE; its routing's optional fields
    # default to None, which its MoE multiplies by
    "nemotron_h": {
        "layer_types": ["linear_attention", "moe", "full_attention", "moe"],
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
    },
    "granitemoehybrid": {"layer_types": ["mamba", "attention", "mamba"]},
    # moe_layer_freq: a stride in some families, a per-layer list in others
    "mimo_v2_flash": {"moe_layer_freq": [0, 1, 1]},
    "glm_moe_dsa": {"moe_layer_freq": 1},
    "mistral3": {"text_config": {"model_type": "mistral4", "rope_parameters": _MISTRAL4_ROPE}},
    "mistral4": {"rope_parameters": _MISTRAL4_ROPE},
    "mellum": {  # rope by attention kind
        "rope_parameters": {
            kind: {"rope_type": "default", "rope_theta": 10000.0}
            for kind in ("sliding_attention", "full_attention")
        }
    },
}


def model_modules() -> list[str]:
    """Every model module of the installed mlx-lm: a module of mlx_lm.models that defines (or
    imports) `Model` and `ModelArgs`, whether or not it imports here."""
    import mlx_lm.models

    names = []
    for info in pkgutil.iter_modules(mlx_lm.models.__path__):
        src = _source(info.name)
        if re.search(r"\bModel\b", src) and re.search(r"\bModelArgs\b", src):
            names.append(info.name)
    return sorted(names)


def _source(module: str) -> str:
    import mlx_lm.models

    try:
        return Path(mlx_lm.models.__path__[0], f"{module}.py").read_text(encoding="utf-8")
    except OSError:
        return ""


def uses_switch_layers(module: str, seen: frozenset[str] = frozenset()) -> bool:
    """Whether `module`'s source, or a model module it imports, uses SwitchGLU or SwitchMLP:
    how a module that does not build tiny is still known to be MoE."""
    if module in seen or module == "switch_layers":
        return False
    src = _source(module)
    if re.search(r"\bSwitch(GLU|MLP)\b", src):
        return True
    imported = set(re.findall(r"^from \.([\w-]+) import", src, re.M))
    for names in re.findall(r"^from \. import ([\w, ]+)", src, re.M):
        imported.update(n.strip() for n in names.split(","))
    return any(uses_switch_layers(m, seen | {module}) for m in imported)


def _args_fields(args_class: Any) -> dict[str, dataclasses.Field[Any]]:
    if dataclasses.is_dataclass(args_class):
        return {f.name: f for f in dataclasses.fields(args_class)}
    return {}


def _required(field: dataclasses.Field[Any]) -> bool:
    return field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING


def _tiny_for(fields: dict[str, dataclasses.Field[Any]], model_type: str) -> dict[str, Any]:
    cfg: dict[str, Any] = {"model_type": model_type}
    for name, field in fields.items():
        if name in TINY and (name not in BEHAVIOUR or _required(field)):
            cfg[name] = TINY[name]
    return cfg


def tiny_config(model_type: str) -> dict[str, Any]:
    """The tiny config of `model_type` from its ModelArgs fields (TINY; a nested text_config
    gets every TINY entry, for the text model's own args class to pick from)."""
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    fields = _args_fields(module.ModelArgs)
    cfg = _tiny_for(fields, model_type)
    override = dict(OVERRIDES.get(model_type, {}))
    if "text_config" in fields:
        # The text model's args class is not known by name: a behaviour field is filled where
        # any args dataclass of the module, or of a model module it imports, requires it.
        spaces = [vars(module)]
        spaces += [vars(m) for m in vars(module).values() if inspect.ismodule(m)]
        required = {
            f.name
            for space in spaces
            for obj in space.values()
            if isinstance(obj, type) and dataclasses.is_dataclass(obj)
            for f in dataclasses.fields(obj)
            if _required(f)
        }
        text = {k: v for k, v in TINY.items() if k not in BEHAVIOUR or k in required}
        cfg["text_config"] = {**text, "model_type": model_type, **override.pop("text_config", {})}
    return {**cfg, **override}


def build(config: dict[str, Any]) -> Any:
    """mlx-lm's own model for `config`, as mlx_lm.utils.load_model builds it."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    return model_class(args_class.from_dict(config))


def switch_modules(model: Any) -> list[tuple[str, Any]]:
    from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

    return [(n, m) for n, m in model.named_modules() if isinstance(m, (SwitchGLU, SwitchMLP))]


# ---------------------------------------------------------------------------------------------
# Discovery


@dataclasses.dataclass(frozen=True)
class Found:
    """A MoE model type: `build_error` says why its tiny config does not build (then it is
    known to be MoE from its source alone)."""

    model_type: str
    build_error: str | None = None


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    if len(text) > 300:
        text = text[:297] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def discover_here() -> list[Found]:
    """The MoE model types of the installed mlx-lm, found in this process (see discover)."""
    found = []
    for name in model_modules():
        try:
            module = importlib.import_module(f"mlx_lm.models.{name}")
            if not (hasattr(module, "Model") and hasattr(module, "ModelArgs")):
                continue
            model = build(tiny_config(name))
        except BaseException as e:  # a module may even sys.exit on import (olmo)
            if isinstance(e, KeyboardInterrupt):
                raise
            if uses_switch_layers(name):
                found.append(Found(name, _one_line(e)))
            continue
        if switch_modules(model):
            found.append(Found(name, None))
    return found


def discover(timeout: float = 600.0) -> list[Found]:
    """The MoE model types, found in a subprocess (importing every model module of mlx-lm and
    building each tiny must not take the matrix down)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "found.json")
        failure = _child(["--discover", "--out", str(out)], timeout)
        if failure is not None:
            raise RuntimeError(f"discovering the MoE model types failed: {failure}")
        return [Found(**d) for d in json.loads(out.read_text())]


# ---------------------------------------------------------------------------------------------
# One model type: checkpoints, plain mlx-lm, streamed

PROMPT = [5, 9, 12, 3, 40, 22, 7, 8, 9, 10, 33, 2, 17, 61, 4, 4, 30, 12, 50, 6]
GREEDY_TOKENS = 8
MAX_PARAMETERS = 10_000_000  # far above any tiny config, far below any real default
VARIANTS = ("q4", "f32")  # q4 group 64 bfloat16 (mlx_lm.convert -q); float32 unquantized
PATHS = ("cpu", "mlx")
# The one cell that is not bitwise by contract: unquantized float32 experts on the CPU backend,
# which computes each output as one float32 dot product in its own order where MLX's gather_mm
# takes BLAS's (docs/models.md, "Parity and tolerances"). Within this share of the largest
# logit, with the same greedy tokens, it counts as streaming exactly.
F32_CPU_RTOL = 1e-5


def make_checkpoint(model_type: str, path: Path, variant: str, seed: int = 0) -> Path:
    """A tiny random checkpoint of `model_type` as mlx-lm writes one: its own model class,
    random weights (random_model's), quantized by mlx-lm's quantize_model with the model's own
    quant predicate where it has one (q4 group 64, as `mlx_lm.convert -q`), mlx-lm's save
    utilities and random_model's WordLevel tokenizer."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import quantize_model, save_config, save_model

    from strata_stream.mlx_lm.random_model import randomize, save_tokenizer

    config = tiny_config(model_type)
    model = build(config)
    flat: Any = tree_flatten(model.parameters())
    size = sum(v.size for _, v in flat)
    if size > MAX_PARAMETERS:
        raise ValueError(
            f"the tiny config builds {size} parameters: a size field of its ModelArgs is "
            "missing from TINY"
        )
    randomize(model, seed, mx.bfloat16 if variant == "q4" else mx.float32)
    mx.eval(model.parameters())
    if variant == "q4":
        model, config = quantize_model(model, config, 64, 4)
    path.mkdir(parents=True, exist_ok=True)
    save_model(path, model)
    save_config({**config, "eos_token_id": 1}, path / "config.json")
    save_tokenizer(path)
    return path


def _run(model: Any) -> tuple[Any, list[int]]:
    """Teacher-forced float32 logits over PROMPT and GREEDY_TOKENS greedy tokens after it."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.generate import generate_step

    logits = np.array(model(mx.array([PROMPT])).astype(mx.float32))[0]
    steps = generate_step(mx.array(PROMPT), model, max_tokens=GREEDY_TOKENS)
    return logits, [int(t) for t, _ in steps]


def _compare(ref: tuple[Any, list[int]], got: tuple[Any, list[int]], rtol: float = 0.0) -> str:
    """"exact" when the logits are bitwise equal and the greedy tokens the same; with `rtol`,
    "exact (float32 order, ...)" when they differ by at most rtol of the largest logit and the
    tokens are the same; else "mismatch (...)" naming the difference."""
    import numpy as np

    ref_logits, ref_tokens = ref
    logits, tokens = got
    if np.array_equal(ref_logits, logits, equal_nan=True) and ref_tokens == tokens:
        return "exact"
    if rtol and ref_logits.shape == logits.shape and ref_tokens == tokens:
        d = float(np.nanmax(np.abs(ref_logits.astype(np.float64) - logits)))
        scale = float(np.nanmax(np.abs(ref_logits)))
        if d <= rtol * scale:
            return f"exact (float32 order, max |diff| {d:.2g} of {scale:.2g})"
    if ref_logits.shape != logits.shape:
        diff = f"logits shape {logits.shape} vs {ref_logits.shape}"
    else:
        with np.errstate(invalid="ignore"):
            d = np.abs(ref_logits.astype(np.float64) - logits.astype(np.float64))
        diff = f"max |diff| {np.nanmax(d):.3g}" if np.isfinite(d).any() else "max |diff| nan"
    pairs = enumerate(zip(ref_tokens, tokens, strict=False))
    first = next((i for i, (a, b) in pairs if a != b), None)
    if first is None and len(ref_tokens) != len(tokens):
        first = min(len(ref_tokens), len(tokens))
    where = f"first differing token {first}" if first is not None else "tokens equal"
    return f"mismatch ({diff}, {where})"


# What the design cannot serve, as strata-stream's own refusal says it: such a type is a skip
# naming the reason, not a failure. Any other refusal fails the row.
DESIGN_LIMITS = (
    # mlx-lm's SwitchMLP (fc1, an activation, fc2): the converter reads gated experts only.
    "routed experts have one input projection and no gate",
    "its experts are mlx-lm SwitchMLP modules",
)


def _failure(e: BaseException) -> str:
    from strata_stream.errors import StrataError

    if isinstance(e, StrataError):
        line = _one_line(e)
        if any(limit in line for limit in DESIGN_LIMITS):
            return f"skip: the pack cannot hold them: {line}"
        return f"refused: {line}"
    return f"crash: {_one_line(e)}"


def run_type_here(model_type: str, root: Path) -> dict[str, Any]:
    """The row of `model_type`: {variant: {path: result}} plus notes, computed in this process."""
    import mlx.core as mx
    import mlx_lm
    import numpy as np

    cells: dict[str, dict[str, str]] = {}
    notes: list[str] = []
    for variant in VARIANTS:
        path = root / variant
        try:
            make_checkpoint(model_type, path, variant)
        except Exception as e:
            reason = f"skip: mlx-lm fails to build or save it tiny: {_one_line(e)}"
            cells[variant] = dict.fromkeys(PATHS, reason)
            continue
        try:
            loaded: Any = mlx_lm.load(str(path))
            ref_model = loaded[0]
            ref = _run(ref_model)
            del ref_model
        except Exception as e:
            reason = f"skip: plain mlx-lm fails to load or run it tiny: {_one_line(e)}"
            cells[variant] = dict.fromkeys(PATHS, reason)
            continue
        if not np.isfinite(ref[0]).all():
            notes.append(f"{variant}: plain mlx-lm's logits hold non-finite values")
        pack_path = root / f"{variant}.strpk"
        try:
            from strata_stream import StreamConfig
            from strata_stream.arena_budget import ExpertStream_min_slots
            from strata_stream.convert import convert
            from strata_stream.mlx_lm import load
            from strata_stream.pack.reader import ExpertPack

            convert(path, pack_path, progress=False)
            with ExpertPack.open(pack_path) as pack:
                stride, records = pack.record_stride, pack.geometry.n_records
                top_k = pack.geometry.top_k
        except Exception as e:
            cells[variant] = dict.fromkeys(PATHS, _failure(e))
            continue
        # Well below every expert resident: a quarter, or the least load accepts.
        arena = max(ExpertStream_min_slots(top_k), records // 4) * stride
        cells[variant] = {}
        base = StreamConfig(io_threads=2, direct_io=False, persist_profile=False)
        for experts in PATHS:
            model = None
            try:
                model, _ = load(
                    str(path),
                    pack_path=pack_path,
                    arena_bytes=arena,
                    config=base,
                    experts=experts,
                    progress=False,
                )
                rtol = F32_CPU_RTOL if (variant, experts) == ("f32", "cpu") else 0.0
                cells[variant][experts] = _compare(ref, _run(model), rtol)
                # experts="cpu" hands a block whose experts the CPU backend cannot compute to
                # MLX's kernels: exact then says nothing of the CPU backend, so say so.
                blocks = getattr(model.strata_engine, "blocks", [])
                kinds = [getattr(b, "kernels", None) for b in blocks]
                if experts == "cpu" and "mlx" in kinds:
                    notes.append(
                        f"{variant}/cpu: {kinds.count('mlx')} of {len(kinds)} MoE blocks "
                        "ran MLX's kernels"
                    )
            except Exception as e:
                cells[variant][experts] = _failure(e)
            finally:
                engine = getattr(model, "strata_engine", None)
                if engine is not None:
                    engine.close()
                del model
                mx.clear_cache()
    # The checkpoint's temporary directory says nothing: name the variant alone.
    for row in cells.values():
        for experts, result in row.items():
            row[experts] = result.replace(f"{root}{os.sep}", "")
    return {"cells": cells, "notes": notes}


# ---------------------------------------------------------------------------------------------
# Rows


@dataclasses.dataclass
class Row:
    model_type: str
    cells: dict[str, dict[str, str]]  # variant -> expert path -> result
    notes: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    @property
    def results(self) -> list[str]:
        return [self.cells[v][p] for v in VARIANTS for p in PATHS]

    @property
    def exact(self) -> bool:
        return all(r.startswith("exact") for r in self.results)

    def _named(self, keep: Any) -> list[str]:
        named = [f"{v}/{p}: {self.cells[v][p]}" for v in VARIANTS for p in PATHS]
        return [n for n, r in zip(named, self.results, strict=True) if keep(r)]

    @property
    def failures(self) -> list[str]:
        """The cells that are neither exact nor skipped, named by variant and path."""
        return self._named(lambda r: not r.startswith(("exact", "skip: ")))

    @property
    def skips(self) -> list[str]:
        """The skipped cells (plain mlx-lm cannot build or run the type tiny), with reasons."""
        return self._named(lambda r: r.startswith("skip: "))

    @property
    def summary(self) -> str:
        """exact, or the first cell that is not, named by variant and path."""
        if self.exact:
            return "exact"
        distinct = dict.fromkeys(self.results)
        if len(distinct) == 1:
            return next(iter(distinct))
        bad = [(v, p, self.cells[v][p]) for v in VARIANTS for p in PATHS]
        return "; ".join(f"{v}/{p}: {r}" for v, p, r in bad if not r.startswith("exact"))


def _same_cells(result: str) -> dict[str, dict[str, str]]:
    return {v: dict.fromkeys(PATHS, result) for v in VARIANTS}


def run_type(found: Found, timeout: float) -> Row:
    """The row of one model type, computed in a subprocess with a timeout."""
    if found.build_error is not None:
        reason = f"skip: mlx-lm fails to build it from a tiny config: {found.build_error}"
        return Row(found.model_type, _same_cells(reason))
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"matrix-{found.model_type}-") as tmp:
        out = Path(tmp, "row.json")
        argv = ["--child", found.model_type, "--workdir", tmp, "--out", str(out)]
        failure = _child(argv, timeout)
        seconds = time.monotonic() - start
        if failure is not None:
            return Row(found.model_type, _same_cells(failure), seconds=seconds)
        data = json.loads(out.read_text())
    return Row(found.model_type, data["cells"], data["notes"], seconds)


def _child(argv: list[str], timeout: float) -> str | None:
    """Runs this module with `argv` in a subprocess: None, or a crash result saying how the
    process ended (timeout, signal, exit status with its last error line)."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p
    )}  # fmt: skip
    cmd = [sys.executable, "-m", "tests.model_coverage.mlx_lm_matrix", *argv]
    try:
        proc = subprocess.run(
            cmd, cwd=root, env=env, timeout=timeout, capture_output=True, text=True
        )
    except subprocess.TimeoutExpired:
        return f"crash: timed out after {timeout:.0f} s"
    if proc.returncode == 0:
        return None
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    last = lines[-1].strip() if lines else "no output"
    if proc.returncode < 0:
        return f"crash: killed by signal {-proc.returncode} ({last})"
    return f"crash: exit status {proc.returncode}: {last}"


# ---------------------------------------------------------------------------------------------
# Output


def versions() -> tuple[str, str]:
    from importlib.metadata import version

    return version("mlx-lm"), version("mlx")


def closing_line(rows: list[Row], mlx_lm_version: str) -> str:
    n = sum(r.exact for r in rows)
    return f"mlx-lm {mlx_lm_version}: {n} of {len(rows)} MoE model types stream exactly"


def print_rows(rows: list[Row]) -> None:
    width = max((len(r.model_type) for r in rows), default=10)
    for r in rows:
        notes = f"  [{'; '.join(r.notes)}]" if r.notes else ""
        print(f"{r.model_type:<{width}}  {r.summary}{notes}", flush=True)


def table(rows: list[Row], command: str) -> str:
    """The generated region of docs/models.md."""
    mlx_lm_version, mlx_version = versions()
    lines = [
        f"mlx-lm {mlx_lm_version}, mlx {mlx_version}. Regenerate with `{command}`.",
        "",
        '| model type | q4, experts="cpu" | q4, experts="mlx" | float32, experts="cpu" '
        '| float32, experts="mlx" | notes |',
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [c.replace("|", "\\|") for c in r.results]
        if len(set(cells)) == 1 and not r.exact:
            cells = [cells[0], "", "", ""]
        notes = "; ".join(r.notes).replace("|", "\\|")
        lines.append(f"| {r.model_type} | " + " | ".join([*cells, notes]) + " |")
    lines += ["", closing_line(rows, mlx_lm_version) + "."]
    return "\n".join(lines)


BEGIN, END = "<!-- matrix:mlx_lm -->", "<!-- /matrix:mlx_lm -->"


def write_docs(path: Path, region: str) -> None:
    """Replaces the region between the markers in `path` (the markers must be there)."""
    text = path.read_text(encoding="utf-8")
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise SystemExit(f"{path}: needs one {BEGIN} line before one {END} line")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    path.write_text(f"{head}{BEGIN}\n{region}\n{END}{tail}", encoding="utf-8")


def shard_of(items: list[Found], shard: str) -> list[Found]:
    try:
        i, n = (int(x) for x in shard.split("/"))
    except ValueError:
        raise ValueError(f"--shard takes i/n (two integers), got {shard!r}") from None
    if not 0 <= i < n:
        raise ValueError(f"--shard i/n needs 0 <= i < n, got {shard}")
    return items[i::n]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.model_coverage.mlx_lm_matrix",
        description="Every MoE model type of the installed mlx-lm: streamed vs plain mlx-lm.",
    )
    parser.add_argument("--types", help="comma-separated model types (default: every MoE type)")
    parser.add_argument("--shard", help="i/n: every n-th type from the i-th (0-based)")
    parser.add_argument("--json", type=Path, help="write the rows as JSON here")
    parser.add_argument("--write-docs", type=Path, help="regenerate the matrix region of this file")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per model type")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--discover", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.discover:
        found = discover_here()
        args.out.write_text(json.dumps([dataclasses.asdict(f) for f in found]))
        return 0
    if args.child:
        args.out.write_text(json.dumps(run_type_here(args.child, args.workdir)))
        return 0

    try:
        found = discover()
        if args.types:
            wanted = [t.strip() for t in args.types.split(",") if t.strip()]
            known = {f.model_type: f for f in found}
            unknown = [t for t in wanted if t not in known]
            if unknown:
                parser.error(f"not MoE model types of this mlx-lm: {', '.join(unknown)}")
            found = [known[t] for t in wanted]
        if args.shard:
            found = shard_of(found, args.shard)
    except ValueError as e:
        parser.error(str(e))
    except RuntimeError as e:
        parser.exit(1, f"{parser.prog}: {e}\n")
    start = time.monotonic()
    rows = []
    for f in found:
        row = run_type(f, args.timeout)
        rows.append(row)
        print_rows([row])
    mlx_lm_version, _ = versions()
    print(closing_line(rows, mlx_lm_version), flush=True)
    print(f"({time.monotonic() - start:.0f} s)", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=1))
    if args.write_docs:
        command = "python -m tests.model_coverage.mlx_lm_matrix --write-docs docs/models.md"
        write_docs(args.write_docs, table(rows, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
