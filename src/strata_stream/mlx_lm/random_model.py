"""Random-weight mlx-lm checkpoints of every supported MoE family, built offline.

The one checkpoint builder of the project: for the tests (tiny), the demo, the server's tests
and load benchmark (`make_chat_checkpoint`: a chat template and words to serve) and the
end-to-end benchmark (larger, via `dims`, or `make_large_checkpoint`). Each is made as
`mlx_lm.convert -q` would write it: mlx-lm's own model class with random weights (bf16),
`mlx_lm.utils.quantize_model` at q4 group 64 with 8-bit gates/routers, saved with mlx-lm's save
utilities, plus a small WordLevel tokenizer saved with transformers (no download).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

__all__ = [
    "CHAT_TEMPLATE",
    "CONFIGS",
    "QWEN3_30B_A3B_EXPERTS",
    "VOCAB",
    "WORDS",
    "make_chat_checkpoint",
    "make_checkpoint",
    "make_large_checkpoint",
    "randomize",
    "save_tokenizer",
]

VOCAB = [f"w{i}" for i in range(60)]
# The chat checkpoint's words (make_chat_checkpoint): a server's text reads as words.
_WORDS = (
    "the a an of to and in is it you that he was for on are with as his they be at one have "
    "this from or had by hot word but what some we can out other were all there when up use "
    "your how said each she which do their time if will way about many then them write would "
    "like so these her long make thing see him two has look more day could go come did number "
    "sound no most people my over know water than call first who may down side been now find "
    "hello world model expert stream arena token layer cache slot read user assistant system"
)
WORDS = tuple(_WORDS.split())
_PLAIN_SPECIAL = ("<unk>", "<eos>")
_CHAT_SPECIAL = ("<unk>", "<pad>", "<eos>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)
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


def randomize(model: Any, seed: int, dtype: Any = mx.bfloat16) -> None:
    """Random weights of `dtype` for every float parameter of an mlx-lm `model`, scaled so a
    tiny model's activations stay finite (matrices by 1/sqrt(width), norms near 1)."""
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


def _predicate(path: str, module: Any) -> bool | dict[str, Any]:
    if path.endswith(("mlp.gate", "router", "shared_expert_gate", "moe.gate")):
        # 8-bit group 64 where the width allows (a narrower model keeps float gates).
        return {"group_size": 64, "bits": 8} if module.weight.shape[-1] % 64 == 0 else False
    return True


def save_tokenizer(path: Path, chat: bool = False, context: int | None = None) -> dict[str, int]:
    """A WordLevel tokenizer over VOCAB (special tokens <unk> 0, <eos> 1, then the words), or
    with `chat` over WORDS with a pad token, chat markers and CHAT_TEMPLATE; returns its vocab.
    `context`: the tokenizer's model_max_length."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    special, words = (_CHAT_SPECIAL, WORDS) if chat else (_PLAIN_SPECIAL, tuple(VOCAB))
    vocab = {tok: i for i, tok in enumerate((*special, *words))}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    extra: dict[str, Any] = {"model_max_length": context} if context else {}
    if chat:
        tok.add_special_tokens(list(special))
        extra["pad_token"] = "<pad>"
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call,unused-ignore]
        tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>", **extra
    )
    if chat:
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))  # type: ignore[no-untyped-call,unused-ignore]
    return vocab


def make_checkpoint(
    family: str,
    path: Path,
    seed: int = 0,
    quantize: bool = True,
    dims: dict[str, Any] | None = None,
    dtype: Any = mx.bfloat16,
    bits: int = 4,
    group_size: int = 64,
    experts_mode: str = "affine",
    chat: bool = False,
    experts_predicate: Callable[[str, Any], bool | dict[str, Any]] | None = None,
) -> Path:
    """A random checkpoint of `family` at `path` (q4 g64, 8-bit gates; or unquantized).

    Tiny by default; `dims` overrides config entries (hidden_size, num_experts, ...); `dtype` is
    the model dtype (MLX's CPU gather_mm runs float32 only, so unquantized CPU models need it);
    `bits` / `group_size` quantize everything but the gates (8-bit, group 64, where the width
    allows). experts_mode "mxfp4" quantizes the routed experts to mxfp4 instead, as gpt-oss's
    published MLX checkpoints are (the rest as `bits` / `group_size` say). `chat`: the chat
    tokenizer (save_tokenizer), and the lm_head rows of its special tokens and of ids past its
    vocabulary are zero, so their logits are exactly 0 while the largest other logit is
    positive for any realistic hidden state: greedy text is words and never ends early, which
    keeps generation lengths (and the tests that count tokens) deterministic.
    `experts_predicate(path, module)` decides for the routed experts' modules (SwitchLinear)
    instead, as mlx-lm's quantization predicates of some families do: False keeps one
    unquantized, a dict gives it its own bits and group size."""
    from mlx_lm.utils import _get_classes, quantize_model, save_config, save_model

    if family not in CONFIGS:
        raise ValueError(f"family must be one of {', '.join(CONFIGS)}, got {family!r}")
    config = {**_COMMON, **CONFIGS[family], **(dims or {})}
    vocab = {tok: i for i, tok in enumerate((*_CHAT_SPECIAL, *WORDS))} if chat else None
    if vocab is not None:
        rows = -(-len(vocab) // 64) * 64  # the vocabulary, rounded up as real heads are
        config = {**config, "vocab_size": max(config["vocab_size"], rows),
                  "eos_token_id": vocab["<eos>"]}  # fmt: skip
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    randomize(model, seed, dtype)
    if vocab is not None:
        head = model.lm_head.weight
        words = range(len(_CHAT_SPECIAL), len(vocab))
        keep = mx.array([[1.0 if i in words else 0.0] for i in range(head.shape[0])])
        model.lm_head.weight = (head * keep).astype(head.dtype)
    mx.eval(model.parameters())
    if quantize:
        predicate = _predicate
        if experts_mode != "affine" or experts_predicate is not None:
            from mlx_lm.models.switch_layers import SwitchLinear

            def predicate(path: str, module: Any) -> bool | dict[str, Any]:
                if isinstance(module, SwitchLinear):
                    if experts_predicate is not None:
                        return experts_predicate(path, module)
                    return {"group_size": 32, "bits": 4, "mode": experts_mode}
                return _predicate(path, module)

        model, config = quantize_model(model, config, group_size, bits, quant_predicate=predicate)
    path.mkdir(parents=True, exist_ok=True)
    save_model(path, model)
    eos = 1 if vocab is None else vocab["<eos>"]
    save_config({**config, "eos_token_id": eos}, path / "config.json")
    save_tokenizer(path, chat, config.get("max_position_embeddings") if chat else None)
    if chat:
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return path


def make_chat_checkpoint(
    path: str | Path, *, seed: int = 2, context: int = 8192, n_layers: int = 2
) -> Path:
    """A tiny qwen3_moe checkpoint to serve: the chat tokenizer and template, a context of
    `context` tokens, words for text and greedy decoding that never stops early (see
    make_checkpoint's `chat`). The server's tests and benchmarks/serve_load.py use it."""
    dims = {"num_hidden_layers": n_layers, "max_position_embeddings": context}
    return make_checkpoint("qwen3_moe", Path(path), seed=seed, dims=dims, chat=True)


# Qwen3-30B-A3B's routed-expert shapes; attention and vocabulary kept tiny (they are not what
# streaming is about, and small they cost nothing to build or load).
QWEN3_30B_A3B_EXPERTS: dict[str, Any] = {
    "hidden_size": 2048,
    "moe_intermediate_size": 768,
    "intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
}
_LAYER0 = "model.layers.0."


def _random_quantized(
    shape: tuple[int, ...], bits: int, group_size: int, scale: float
) -> tuple[Any, Any, Any]:
    """(packed uint32 weight, bf16 scales, bf16 biases) of an affine-quantized random matrix
    whose dequantized values have mean 0 and standard deviation about `scale`."""
    *lead, rows, packed = shape
    cols = packed * 32 // bits
    levels = (1 << bits) - 1
    low, high = -(1 << 31), (1 << 31) - 1  # every int32 (but one), seen as uint32 bit patterns
    weight = mx.random.randint(low, high, tuple(shape), dtype=mx.int32).view(mx.uint32)
    level_std = math.sqrt(((levels + 1) ** 2 - 1) / 12.0)  # of a uniform integer in [0, levels]
    groups = (*lead, rows, cols // group_size)
    scales = (scale / level_std) * (1.0 + 0.1 * mx.random.normal(groups))
    biases = -(levels / 2.0) * scales  # centre the levels on zero
    return weight, scales.astype(mx.bfloat16), biases.astype(mx.bfloat16)


def make_large_checkpoint(
    path: Path,
    num_layers: int = 12,
    seed: int = 0,
    dims: dict[str, Any] | None = None,
) -> Path:
    """A random qwen3_moe checkpoint with large experts (Qwen3-30B-A3B's by default), written
    straight to safetensors as ``mlx_lm.convert -q`` lays it out (q4 g64 experts, 8-bit gates).

    Float init plus quantization of the whole model would need tens of GB, so only a 1-layer
    model is built that way, as the template of names, shapes and dtypes (and of the small
    dense tensors, which every layer shares); each layer's router and experts are random packed
    integers with scales chosen so activations stay of order one. One shard per layer."""
    from mlx_lm.utils import _get_classes, quantize_model, save_config

    config = {**_COMMON, **CONFIGS["qwen3_moe"], **QWEN3_30B_A3B_EXPERTS, **(dims or {})}
    config["num_hidden_layers"] = 1
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    randomize(model, seed)
    mx.eval(model.parameters())
    model, config = quantize_model(model, config, 64, 4, quant_predicate=_predicate)
    template: dict[str, Any] = dict(tree_flatten(model.parameters()))
    del model

    path.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    total = 0
    for layer in range(num_layers):
        mx.random.seed(seed * 100003 + layer + 1)
        shard: dict[str, Any] = {}
        prefix = f"model.layers.{layer}."
        for name, value in template.items():
            if not name.startswith(_LAYER0):
                if layer == 0:
                    shard[name] = value
                continue
            local = name[len(_LAYER0) :]
            module, _, kind = local.rpartition(".")
            if not (module == "mlp.gate" or module.startswith("mlp.switch_mlp.")):
                shard[prefix + local] = value  # attention and norms: the template's
                continue
            if kind != "weight":
                continue  # written with their weight
            bits = 8 if module == "mlp.gate" else 4
            fan_in = value.shape[-1] * 32 // bits
            w, s, b = _random_quantized(value.shape, bits, 64, 1.0 / math.sqrt(fan_in))
            shard[f"{prefix}{module}.weight"] = w
            shard[f"{prefix}{module}.scales"] = s
            shard[f"{prefix}{module}.biases"] = b
        mx.eval(shard)
        fname = f"model-{layer + 1:05d}-of-{num_layers:05d}.safetensors"
        mx.save_safetensors(str(path / fname), shard, metadata={"format": "mlx"})
        for name, value in shard.items():
            weight_map[name] = fname
            total += value.nbytes
        del shard

    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))
    config["num_hidden_layers"] = num_layers
    for key in ("quantization", "quantization_config"):
        quant = config.get(key)
        if not isinstance(quant, dict):
            continue
        per_layer = {k: v for k, v in quant.items() if k.startswith(_LAYER0)}
        for k, v in per_layer.items():
            for layer in range(num_layers):
                quant[f"model.layers.{layer}." + k[len(_LAYER0) :]] = v
    save_config({**config, "eos_token_id": 1}, path / "config.json")
    save_tokenizer(path)
    return path
