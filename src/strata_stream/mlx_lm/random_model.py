"""Random-weight mlx-lm checkpoints of every supported MoE family, built offline.

For the tests (tiny), the demo and the end-to-end benchmark (larger, via `dims`). Each is made
as `mlx_lm.convert -q` would write it: mlx-lm's own model class with random weights (bf16),
`mlx_lm.utils.quantize_model` at q4 group 64 with 8-bit gates/routers, saved with mlx-lm's save
utilities, plus a small WordLevel tokenizer saved with transformers (no download).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

__all__ = ["CONFIGS", "VOCAB", "make_checkpoint", "save_tokenizer"]

VOCAB = [f"w{i}" for i in range(60)]
HIDDEN, INTER, EXPERTS, TOP_K = 64, 64, 8, 2

_COMMON: dict[str, Any] = {
    "hidden_size": HIDDEN,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "vocab_size": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "num_experts_per_tok": TOP_K,
}

CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        "num_hidden_layers": 3,
        "intermediate_size": 128,
        "num_experts": EXPERTS,
        "moe_intermediate_size": INTER,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
    },
    "olmoe": {
        "model_type": "olmoe",
        "num_hidden_layers": 2,
        "intermediate_size": INTER,
        "num_experts": EXPERTS,
        "norm_topk_prob": False,
    },
    "mixtral": {
        "model_type": "mixtral",
        "num_hidden_layers": 2,
        "intermediate_size": INTER,
        "num_local_experts": EXPERTS,
    },
    "qwen2_moe": {
        "model_type": "qwen2_moe",
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_experts": EXPERTS,
        "moe_intermediate_size": INTER,
        "shared_expert_intermediate_size": 64,
    },
    "deepseek_v3": {
        "model_type": "deepseek_v3",
        "num_hidden_layers": 3,
        "intermediate_size": 128,
        "moe_intermediate_size": INTER,
        "n_routed_experts": EXPERTS,
        "n_shared_experts": 1,
        "n_group": 2,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1,
        "kv_lora_rank": 32,
        "q_lora_rank": 32,
        "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 16,
        "v_head_dim": 32,
        "norm_topk_prob": True,
    },
    "gpt_oss": {
        "model_type": "gpt_oss",
        "num_hidden_layers": 2,
        "num_local_experts": EXPERTS,
        "intermediate_size": INTER,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
    },
}


def _randomize(model: Any, seed: int, dtype: Any = mx.bfloat16) -> None:
    mx.random.seed(seed)
    new: list[tuple[str, Any]] = []
    flat: Any = tree_flatten(model.parameters())
    for name, p in flat:
        if p.dtype not in (mx.float32, mx.float16, mx.bfloat16):
            new.append((name, p))
            continue
        if p.ndim >= 2:
            v = mx.random.normal(p.shape) / math.sqrt(p.shape[-1])
            if name.endswith("embed_tokens.weight"):
                v = mx.random.normal(p.shape)
        elif name.endswith("norm.weight") or "layernorm" in name or "norm" in name.split(".")[-2]:
            v = 1.0 + 0.1 * mx.random.normal(p.shape)
        else:  # biases, sinks, correction biases: small but not zero, so their paths count
            v = 0.2 * mx.random.normal(p.shape)
        new.append((name, v.astype(dtype)))
    model.update(tree_unflatten(new))


def _predicate(path: str, module: Any) -> bool | dict[str, int]:
    if path.endswith(("mlp.gate", "router", "shared_expert_gate", "moe.gate")):
        return {"group_size": 64, "bits": 8}
    return True


def save_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(VOCAB)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call,unused-ignore]
        tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>"
    )
    fast.save_pretrained(str(path))  # type: ignore[no-untyped-call,unused-ignore]


def make_checkpoint(
    family: str,
    path: Path,
    seed: int = 0,
    quantize: bool = True,
    dims: dict[str, Any] | None = None,
    dtype: Any = mx.bfloat16,
) -> Path:
    """A random checkpoint of `family` at `path` (q4 g64, 8-bit gates; or unquantized).

    Tiny by default; `dims` overrides config entries (hidden_size, num_experts, ...); `dtype` is
    the model dtype (MLX's CPU gather_mm runs float32 only, so unquantized CPU models need it)."""
    from mlx_lm.utils import _get_classes, quantize_model, save_config, save_model

    if family not in CONFIGS:
        raise ValueError(f"family must be one of {', '.join(CONFIGS)}, got {family!r}")
    config = {**_COMMON, **CONFIGS[family], **(dims or {})}
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    _randomize(model, seed, dtype)
    mx.eval(model.parameters())
    if quantize:
        model, config = quantize_model(model, config, 64, 4, quant_predicate=_predicate)
    path.mkdir(parents=True, exist_ok=True)
    save_model(path, model)
    save_config({**config, "eos_token_id": 1}, path / "config.json")
    save_tokenizer(path)
    return path
