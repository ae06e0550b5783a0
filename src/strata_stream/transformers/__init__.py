"""Hugging Face transformers models whose routed experts stream from SSD through strata-stream.

    from transformers import AutoTokenizer
    from strata_stream.transformers import load

    model = load("path/to/hf-model", arena_bytes=8 << 30)
    tokenizer = AutoTokenizer.from_pretrained("path/to/hf-model")
    out = model.generate(**tokenizer("Hello", return_tensors="pt"), max_new_tokens=32)

`load` mirrors AutoModelForCausalLM.from_pretrained; `model_class=` builds another class
transformers has for the checkpoint (``transformers.AutoModel`` for a multimodal model's text
sub-config, a token-classification head), whose experts stream alike. The model routes with
its own routers and keeps its shared experts (families.py); the engine streams the chosen
experts into a bounded arena and computes them on the CPU backend. docs/transformers.md has
the families and the tolerances.
"""

from __future__ import annotations

from strata_stream.transformers.loader import describe, load, stats_source

__all__ = ["describe", "load", "stats_source"]
