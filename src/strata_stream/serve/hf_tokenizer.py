"""A Hugging Face tokenizer as the server speaks to tokenizers, without mlx-lm.

The routes and the batches use mlx-lm's TokenizerWrapper surface: `encode`, `decode`,
`has_chat_template`, `apply_chat_template`, `eos_token_ids` and a streaming `detokenizer`
(reset, add_token, last_segment, finalize). The transformers engine serves where MLX may not
be installed (a Linux GPU box), so this gives the same surface over a transformers tokenizer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


class StreamingDetokenizer:
    """Text as tokens arrive: the whole sequence is decoded again and the new tail is the
    segment (quadratic in the length, which at serving lengths costs less than a forward pass
    per token). Held back until the next token: a tail ending in U+FFFD (a byte-level BPE splits
    one character over several tokens) and, where the tokenizer cleans up spaces before
    punctuation, a trailing space (the next token may remove it). Should a decode still rewrite
    text already handed out, what is new past it is handed out and the rest stands: sent text
    cannot be taken back."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cleans_spaces = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
        self.reset()

    def reset(self) -> None:
        self._tokens: list[int] = []
        self._sent = 0  # characters of the decoded text handed out
        self.last_segment = ""

    def add_token(self, token: int) -> None:
        self._tokens.append(int(token))
        text = self._decode().rstrip("\ufffd")
        if self._cleans_spaces and text.endswith(" "):
            text = text[:-1]
        self._hand_out(text)

    def finalize(self) -> None:
        self._hand_out(self._decode())

    def _hand_out(self, text: str) -> None:
        self.last_segment = text[self._sent :]
        self._sent = max(self._sent, len(text))

    def _decode(self) -> str:
        return str(self._tokenizer.decode(self._tokens))


class HFTokenizer:
    """`tokenizer` (a transformers tokenizer) with the surface the server uses. eos_token_ids:
    the tokenizer's EOS and the model's (generation_config and config may name several, as
    chat models do for their end-of-turn token)."""

    def __init__(self, tokenizer: Any, eos_token_ids: Iterable[int] = ()) -> None:
        self._tokenizer = tokenizer
        ids = {int(t) for t in eos_token_ids}
        if tokenizer.eos_token_id is not None:
            ids.add(int(tokenizer.eos_token_id))
        self.eos_token_ids = ids

    @property
    def detokenizer(self) -> StreamingDetokenizer:
        return StreamingDetokenizer(self._tokenizer)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tokenizer, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self._tokenizer.encode(text)]

    def decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids))

    def apply_chat_template(self, messages: list[dict[str, str]], **kwargs: Any) -> list[int]:
        out = self._tokenizer.apply_chat_template(messages, **kwargs)
        if isinstance(out, Mapping):  # transformers 5 may answer a BatchEncoding
            out = out["input_ids"]
        return [int(t) for t in out]

    def __getattr__(self, name: str) -> Any:
        # Private and special names are not delegated: copy.deepcopy (the routes' own copies,
        # app.py) looks such names up on an instance that has no _tokenizer yet.
        if name.startswith("_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self._tokenizer, name)


def model_eos_ids(model: Any) -> set[int]:
    """The EOS ids a transformers model's generation_config and config name."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        eos = getattr(source, "eos_token_id", None)
        if eos is None:
            continue
        ids.update(int(t) for t in (eos if isinstance(eos, (list, tuple)) else [eos]))
    return ids
