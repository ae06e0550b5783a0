"""A tiny random-weight qwen3_moe checkpoint with an offline word-level tokenizer.

Tests and `benchmarks/serve_load.py` serve it: it is built with mlx-lm's own model classes and
save utilities, so plain `mlx_lm.load` reads it back exactly like a downloaded model, and it needs
no network. The weights are random, so the text is nonsense, but greedy decoding is deterministic.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_WORDS = (
    "the a an of to and in is it you that he was for on are with as his they be at one have "
    "this from or had by hot word but what some we can out other were all there when up use "
    "your how said each she which do their time if will way about many then them write would "
    "like so these her long make thing see him two has look more day could go come did number "
    "sound no most people my over know water than call first who may down side been now find "
    "hello world model expert stream arena token layer cache slot read user assistant system"
)
WORDS = tuple(_WORDS.split())
SPECIAL = ("<unk>", "<pad>", "<eos>", "<|im_start|>", "<|im_end|>")
EOS = "<eos>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)


def build_tiny_checkpoint(
    path: str | Path, *, seed: int = 2, context: int = 8192, n_layers: int = 2
) -> Path:
    """Writes config.json, model.safetensors (q4, group 64) and the tokenizer files to `path`.

    The EOS row of lm_head is zero, so its logit is exactly 0 while the largest of the other
    logits is positive for any realistic hidden state: greedy decoding never stops early, which
    keeps generation lengths (and the tests that count tokens) deterministic."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models.qwen3_moe import Model, ModelArgs
    from mlx_lm.utils import save_config, save_model
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    vocab = {tok: i for i, tok in enumerate((*SPECIAL, *WORDS))}
    vocab_size = 128  # >= len(vocab); rows past the tokenizer's vocab are never sampled greedily
    assert len(vocab) <= vocab_size

    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(SPECIAL))
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        eos_token=EOS,
        model_max_length=context,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))

    config: dict[str, Any] = {
        "model_type": "qwen3_moe",
        "hidden_size": 64,
        "num_hidden_layers": n_layers,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": 64,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "max_position_embeddings": context,
        "norm_topk_prob": True,
        "eos_token_id": vocab[EOS],
    }
    mx.random.seed(seed)
    model = Model(ModelArgs.from_dict(config))  # type: ignore[no-untyped-call]
    # Special tokens (EOS among them) and rows past the vocabulary get a zero logit, so greedy
    # text is plain words and never ends early (see the docstring).
    w = model.lm_head.weight
    words = range(len(SPECIAL), len(vocab))
    keep = mx.array([[1.0 if i in words else 0.0] for i in range(w.shape[0])])
    model.lm_head.weight = w * keep
    nn.quantize(model, group_size=64, bits=4)  # type: ignore[attr-defined]
    mx.eval(model.parameters())
    save_model(out, model)
    config["quantization"] = {"group_size": 64, "bits": 4}
    save_config(config, out / "config.json")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": vocab[EOS]}))
    return out
