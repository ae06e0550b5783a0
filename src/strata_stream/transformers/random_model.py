"""Random-weight Hugging Face transformers checkpoints of every supported MoE family, offline.

For the tests (tiny) and demos: transformers' own config and model classes with random weights
scaled so activations stay of order one (transformers' own initialisation, std 0.02, makes a
tiny model's logits nearly flat), written by `save_pretrained` (so in whatever tensor layout
that transformers version writes), plus a small WordLevel tokenizer saved through
`PreTrainedTokenizerFast` (no download).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

__all__ = ["CONFIGS", "VOCAB", "make_checkpoint", "randomize", "save_tokenizer"]

VOCAB = [f"w{i}" for i in range(60)]
HIDDEN, INTER, EXPERTS, TOP_K = 64, 64, 8, 2

_COMMON: dict[str, Any] = {
    "vocab_size": 64,
    "hidden_size": HIDDEN,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "num_experts_per_tok": TOP_K,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 0,
}

# Per family: transformers' config class name and its entries (tiny, every routing feature on).
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_moe": ("Qwen3MoeConfig", {
        "num_hidden_layers": 3, "intermediate_size": 128, "moe_intermediate_size": INTER,
        "num_experts": EXPERTS, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "norm_topk_prob": True,
    }),
    "mixtral": ("MixtralConfig", {
        "num_hidden_layers": 2, "intermediate_size": INTER, "num_local_experts": EXPERTS,
    }),
    "olmoe": ("OlmoeConfig", {
        "num_hidden_layers": 2, "intermediate_size": INTER, "num_experts": EXPERTS,
        "norm_topk_prob": False,
    }),
    "qwen2_moe": ("Qwen2MoeConfig", {
        "num_hidden_layers": 2, "intermediate_size": 128, "moe_intermediate_size": INTER,
        "num_experts": EXPERTS, "shared_expert_intermediate_size": 64, "norm_topk_prob": False,
    }),
    "deepseek_v3": ("DeepseekV3Config", {
        "num_hidden_layers": 3, "intermediate_size": 128, "moe_intermediate_size": INTER,
        "n_routed_experts": EXPERTS, "n_shared_experts": 1, "n_group": 2, "topk_group": 1,
        "routed_scaling_factor": 2.5, "first_k_dense_replace": 1, "kv_lora_rank": 32,
        "q_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 32,
        "head_dim": 16, "num_key_value_heads": 2, "norm_topk_prob": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }),
    "gpt_oss": ("GptOssConfig", {
        "num_hidden_layers": 2, "num_local_experts": EXPERTS, "intermediate_size": INTER,
        "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }),
}  # fmt: skip


def save_tokenizer(path: Path) -> None:
    """A WordLevel tokenizer over VOCAB ("<unk>" 0, "<eos>" 1, then "w0".."w59")."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(VOCAB)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call,unused-ignore]
        tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>", pad_token="<unk>"
    )
    fast.save_pretrained(str(path))  # type: ignore[no-untyped-call,unused-ignore]


def randomize(model: Any, seed: int) -> None:
    """Random weights of order one in place of transformers' own initialisation (std 0.02,
    which leaves a tiny model's logits nearly flat): embedding tables N(0, 1), matrices and
    fused experts N(0, 1 / fan_in), norms near one, biases small but not zero (so their paths
    count). Rotary frequencies are left as computed. Any model: the coverage matrix uses it too.
    """
    import torch

    embeddings = {
        f"{name}.weight" if name else "weight"
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Embedding)
    }
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if not p.is_floating_point() or "rotary" in name or "inv_freq" in name:
                continue
            v = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            leaf = name.rsplit(".", 1)[-1]
            if p.ndim >= 2:
                # [.., out, in] for Linear weights and fused experts; gpt-oss's fused experts
                # are [E, in, out], the same scale either way for these square-ish sizes.
                v = v if name in embeddings else v / math.sqrt(p.shape[-1])
            elif "norm" in name:
                v = 1.0 + 0.1 * v
            elif leaf == "sinks":
                v = 0.5 * v
            else:  # biases, correction biases: small but not zero, so their paths count
                v = 0.2 * v
            p.copy_(v.to(p.dtype))


def make_checkpoint(
    family: str,
    path: Path,
    seed: int = 0,
    dtype: str = "float32",
    dims: dict[str, Any] | None = None,
) -> Path:
    """A random checkpoint of `family` at `path`, saved by transformers in `dtype` ("float32" or
    "bfloat16"); `dims` overrides config entries."""
    import torch
    import transformers

    if family not in CONFIGS:
        raise ValueError(f"family must be one of {', '.join(CONFIGS)}, got {family!r}")
    class_name, entries = CONFIGS[family]
    config = getattr(transformers, class_name)(**{**_COMMON, **entries, **(dims or {})})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call,unused-ignore]
        config, dtype=torch.float32
    )
    randomize(model, seed)
    model = model.to(getattr(torch, dtype))
    model.config.dtype = dtype
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    save_tokenizer(path)
    return path
