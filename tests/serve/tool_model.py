"""A tiny checkpoint whose chat template defines tools (Qwen3's, tests/data), and a way to make
its random-weight model write a tool call.

The tokenizer is the chat checkpoint's WordLevel one plus the tokens a Qwen3 tool call is
written with: `<tool_call>`, `</tool_call>`, `<think>`, `</think>` (Qwen3's added tokens) and
the whitespace-free pieces of one JSON call, so that the call the model is made to write decodes
to `<tool_call> {"name": "get_weather", "arguments": {"city": "Paris"}} </tool_call>`.

A random model never writes that by itself. `ForcedReply` wraps the real model (the one the
server's batch runs) and, while armed, makes the next token after each token of a fixed chain a
certainty: after the generation prompt's last token the call's first token, and so on to EOS.
Every other position keeps the model's own logits, so what the server does with the tokens
(detokenizing, stop strings, splitting out the call, the API's framing) is its real path.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parent.parent / "data"
QWEN3_TEMPLATE = (DATA / "qwen3_chat_template.jinja").read_text()

CALL_ARGS = {"city": "Paris"}
CALL_NAME = "get_weather"
# The call as whitespace-free pieces: the WordLevel tokenizer splits on whitespace and joins
# decoded tokens with one space.
CALL_TOKENS = [
    "<tool_call>",
    '{"name":',
    f'"{CALL_NAME}",',
    '"arguments":',
    '{"city":',
    '"Paris"}}',
    "</tool_call>",
]
ADDED = ["<think>", "</think>", *CALL_TOKENS]

# A transformers response_template (its declarative response parser) for what the WordLevel
# tokenizer decodes Qwen3's output to: words and markers joined by single spaces.
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor_pattern": r"<\|im_start\|>\s*assistant\s*",
    "fields": {
        "tool_calls": {
            "open_pattern": r"\s*<tool_call>",
            "close": "</tool_call>",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"\s*<\|im_end\|>", "content": "text"},
    },
}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": CALL_NAME,
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}

# The same tool as the Anthropic API declares it.
ANTHROPIC_TOOL = {
    "name": CALL_NAME,
    "description": WEATHER_TOOL["function"]["description"],
    "input_schema": WEATHER_TOOL["function"]["parameters"],
}


def add_tool_tokens(path: Path, template: str = QWEN3_TEMPLATE) -> None:
    """The checkpoint's tokenizer with the tool tokens and `template`, saved in place."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tok.add_tokens(ADDED)
    tok.chat_template = template
    tok.save_pretrained(path)


def save_word_tool_tokenizer(
    path: Path, words: int = 40, response_template: dict[str, Any] | None = None
) -> None:
    """A WordLevel tokenizer of at most 64 entries (a tiny transformers checkpoint's
    vocabulary): "<unk>" 0, "<eos>" 1, "w0".."w{words-1}", the chat markers and roles of the
    Qwen3 template, and the tool tokens; with the Qwen3 template and, if given, a
    response_template (transformers' own parser of the answers)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    names = [
        "<unk>",
        "<eos>",
        *(f"w{i}" for i in range(words)),
        "<|im_start|>",
        "<|im_end|>",
        "system",
        "user",
        "assistant",
        *ADDED,
    ]
    assert len(names) <= 64
    tok = Tokenizer(WordLevel({n: i for i, n in enumerate(names)}, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.add_tokens(ADDED)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>", pad_token="<unk>"
    )
    fast.chat_template = QWEN3_TEMPLATE
    if response_template is not None:
        fast.response_template = response_template
    fast.save_pretrained(str(path))


def make_tool_checkpoint(chat_checkpoint: Path, dest: Path) -> Path:
    """A copy of a chat checkpoint (make_chat_checkpoint) with the tool tokenizer: the new
    tokens take ids past the chat vocabulary, within the model's padded head."""
    shutil.copytree(chat_checkpoint, dest)
    add_tool_tokens(dest)
    return dest


def chain(tokenizer: Any, eos: int) -> dict[int, int]:
    """token -> the token forced after it: the generation prompt's last token ("assistant"),
    then the call's tokens, then EOS."""
    vocab = tokenizer.get_vocab()
    ids = [vocab["assistant"], *(vocab[t] for t in CALL_TOKENS), eos]
    assert len(set(ids)) == len(ids)
    return dict(zip(ids, ids[1:], strict=False))


class ForcedReply:
    """The mlx-lm model, with the chain's next token forced while `armed`. The server's
    BatchGenerator calls it as `model(inputs, cache=...)`; logits [B, L, V], of which the last
    position of each row gives that row's next token."""

    def __init__(self, model: Any, forced: dict[int, int]) -> None:
        self._model = model
        self._forced = forced
        self.on = False

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        self.on = True
        try:
            yield
        finally:
            self.on = False

    def __call__(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        import mlx.core as mx
        import numpy as np

        logits = self._model(inputs, *args, **kwargs)
        if not self.on:
            return logits
        last = np.array(inputs[:, -1]).tolist()
        vocab = logits.shape[-1]
        bias = np.zeros((len(last), 1, vocab), dtype=np.float32)
        for row, token in enumerate(last):
            if token in self._forced:
                bias[row, 0, :] = -1e9
                bias[row, 0, self._forced[token]] = 0.0
        tail = logits[:, -1:, :] + mx.array(bias).astype(logits.dtype)
        return mx.concatenate([logits[:, :-1, :], tail], axis=1)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def force_torch(model: Any, forced: dict[int, int]) -> ForcedReply:
    """The same forcing on a transformers model, by a forward hook on the model itself (the
    transformers batch calls `model(input_ids=..., ...)` and reads `.logits[0, -1]`). Returns
    the switch (its `armed()`); the model is the one to serve."""
    switch = ForcedReply(model, forced)

    def hook(module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> Any:
        if not switch.on:
            return output
        ids = kwargs.get("input_ids", args[0] if args else None)
        logits = output.logits
        for row in range(ids.shape[0]):
            token = int(ids[row, -1])
            if token in forced:
                logits[row, -1, :] = -1e9
                logits[row, -1, forced[token]] = 0.0
        return output

    model.register_forward_hook(hook, with_kwargs=True)
    return switch


def hf_messages_round_trip(user: str, call_id: str, result: str) -> list[dict[str, Any]]:
    """The conversation after one call and its result, as chat templates read it (the oracle's
    input, written here independently of the server's conversion)."""
    return [
        {"role": "user", "content": user},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": CALL_NAME, "arguments": CALL_ARGS},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "name": CALL_NAME, "content": result},
    ]


def call_text() -> str:
    return json.dumps({"name": CALL_NAME, "arguments": CALL_ARGS})
