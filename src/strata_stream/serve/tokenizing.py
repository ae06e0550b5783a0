"""The request handlers' tokenizers, and the longest prompt that can fit the context.

The worker detokenizes every sampled token with the served tokenizer (under its lock: fast
tokenizers raise "Already borrowed" when two threads use one at once). If the handlers encoded
prompts with that same tokenizer, one long prompt being tokenized would hold the lock, and with
it every running stream, for as long as it takes. The handlers use copies of their own instead
(`TokenizerPool`, a few borrowed in turn), so tokenizing a prompt never waits for the batch and
the batch never waits for it (the tokenizers' Rust core releases the GIL while it encodes).

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
import threading
from collections.abc import Iterator
from typing import Any


class TokenizerPool:
    """`size` copies of a tokenizer, made now (before the worker uses the original), each
    borrowed by one thread at a time."""

    def __init__(self, tokenizer: Any, size: int) -> None:
        self._free = [copy.deepcopy(tokenizer) for _ in range(size)]
        self._returned = threading.Condition()

    @contextlib.contextmanager
    def borrow(self) -> Iterator[Any]:
        with self._returned:
            while not self._free:
                self._returned.wait()
            tokenizer = self._free.pop()
        try:
            yield tokenizer
        finally:
            with self._returned:
                self._free.append(tokenizer)
                self._returned.notify()


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
    lengths = [len(t) for t in (*vocab, *added) if isinstance(t, str)]
    return max(lengths) if lengths else None


def max_prompt_chars(context: int | None, tokenizer: Any) -> int | None:
    """Characters beyond which a prompt cannot fit `context` tokens unless its tokenizer
    folds unknown text into <unk> tokens (None: no bound known)."""
    if context is None:
        return None
    longest = longest_token_chars(tokenizer)
    if longest is None:
        return None
    return 2 * context * max(longest, 1)


__all__ = ["TokenizerPool", "longest_token_chars", "max_prompt_chars"]
