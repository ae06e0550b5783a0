"""The request handlers' tokenizers, and the longest prompt that can fit the context.

The worker detokenizes every sampled token with the served tokenizer (under its lock: fast
tokenizers raise "Already borrowed" when two threads use one Rust tokenizer at once). If the
handlers encoded prompts with that same tokenizer, one long prompt being tokenized would hold
the lock, and with it every running stream, for as long as it takes. The handlers encode with
a copy of their own instead (`own_copy`: the Python wrapper shared, the Rust tokenizer its own,
which is what a borrow is of), under a lock of their own, so tokenizing a prompt never waits
for the batch and the batch never waits for it (the Rust core releases the GIL while it
encodes). One copy: copying a tokenizer of a 150,000-token vocabulary costs about a second.

A prompt is refused without being tokenized whole when it has more characters than the
context's tokens can spell (`max_prompt_chars`: context x the vocabulary's longest token in
characters, doubled for normalizers that fold several characters into one, as Unicode
composition does): the routes tokenize only that many of its first characters, and refuse it
when those alone reach the context. For byte-level and byte-fallback tokenizers (the served
models') they always do; a tokenizer that folds unknown text into one <unk> token can spell
more per token, and then the prompt is tokenized whole as usual, off the batch.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import threading
from collections.abc import Iterator
from typing import Any


def own_copy(tokenizer: Any) -> Any:
    """`tokenizer` (a wrapper such as mlx-lm's TokenizerWrapper, a transformers tokenizer, or
    a tokenizers.Tokenizer) with a Rust tokenizer of its own at the bottom; the Python layers
    above it are shallow copies (their tables are only read). Anything else is deep-copied."""
    try:
        from tokenizers import Tokenizer
    except ImportError:  # pragma: no cover - transformers' fast tokenizers need it
        return copy.deepcopy(tokenizer)
    if isinstance(tokenizer, Tokenizer):
        return Tokenizer.from_str(tokenizer.to_str())
    inner = vars(tokenizer).get("_tokenizer") if hasattr(tokenizer, "__dict__") else None
    if inner is None:
        return copy.deepcopy(tokenizer)
    twin = copy.copy(tokenizer)
    vars(twin)["_tokenizer"] = own_copy(inner)  # past any __setattr__ the wrapper defines
    return twin


class OwnTokenizer:
    """A copy of a tokenizer (made now, before the worker uses the original), used by one
    thread at a time."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = own_copy(tokenizer)
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def borrow(self) -> Iterator[Any]:
        with self._lock:
            yield self._tokenizer


def longest_token_chars(tokenizer: Any) -> int | None:
    """The most characters one token of the vocabulary spells (its string in the vocabulary:
    a byte-level BPE token's string has one character per byte, at least as many as the text
    it stands for); None when the tokenizer does not list its vocabulary."""
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    try:
        vocab = inner.get_vocab()
        added: dict[str, int] = getattr(inner, "get_added_vocab", dict)()
    except Exception:
        return None
    return max(map(len, itertools.chain(vocab, added)), default=None)


def max_prompt_chars(context: int | None, tokenizer: Any) -> int | None:
    """Characters beyond which a prompt cannot fit `context` tokens unless its tokenizer
    folds unknown text into <unk> tokens (None: no bound known)."""
    if context is None:
        return None
    longest = longest_token_chars(tokenizer)
    if longest is None:
        return None
    return 2 * context * max(longest, 1)


__all__ = ["OwnTokenizer", "longest_token_chars", "max_prompt_chars", "own_copy"]
