"""Prompt caches on the transformers engine (serve/prompt_cache_torch.py): a streamed model's
answer to a prompt that starts with a kept prefix (in memory, then from the file after a
restart) is bitwise its answer from a server that keeps no cache, tokens and log-probabilities;
a damaged file is refused."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from serve.harness import hf_tokenizer, quarter_streamed, serving  # noqa: E402
from serve.helpers import complete_scored, counter  # noqa: E402
from strata_stream.serve import ServeConfig  # noqa: E402
from strata_stream.serve.prompt_cache import PromptCacheConfig  # noqa: E402

if TYPE_CHECKING:
    from test_transformers_families import Family

MODEL_ID = "tiny-hf-qwen3-moe"
CHUNK = 32


@pytest.fixture(scope="module")
def fam(hf_tool_family: Family) -> Family:
    """The checkpoint with the WordLevel tokenizer (conftest), shared with the messages tests:
    this test reads it, never changes it."""
    return hf_tool_family


@pytest.fixture(scope="module")
def prompts(fam: Family) -> tuple[list[int], list[int], int]:
    vocab = hf_tokenizer(fam).vocab_size
    rng = np.random.default_rng(37)
    prefix = [int(t) for t in rng.integers(3, vocab, 150)]
    return (prefix + [int(t) for t in rng.integers(3, vocab, 9)],
            prefix + [int(t) for t in rng.integers(3, vocab, 5)], len(prefix))  # fmt: skip


@contextmanager
def cached_serving(fam: Family, cache: PromptCacheConfig | None) -> Iterator[str]:
    model = quarter_streamed(fam)
    config = ServeConfig(model_id=MODEL_ID, prefill_chunk=CHUNK)
    with serving(model, hf_tokenizer(fam), config, prompt_cache=cache, engine="transformers",
                 close_engine=True) as server:  # fmt: skip
        yield server.url


def complete(url: str, prompt: list[int]) -> tuple[str, Any, Any]:
    return complete_scored(url, prompt, 6, model=MODEL_ID)


def test_a_kept_prefix_answers_bitwise_as_cold_in_memory_and_after_a_restart(
    fam: Family, prompts: tuple[list[int], list[int], int], tmp_path: Path
) -> None:
    first, second, n_prefix = prompts
    with cached_serving(fam, None) as url:
        cold = [complete(url, first), complete(url, second)]
    config = PromptCacheConfig(directory=tmp_path)
    with cached_serving(fam, config) as url:
        assert complete(url, first) == cold[0]
        assert complete(url, second) == cold[1]  # warm in memory
        assert counter(url, "strata_serve_prompt_cache_hits") == 1
        # Whole prefill chunks of the prefix: what a cold read computed in the same calls.
        assert counter(url, "strata_serve_prompt_cache_tokens") == n_prefix - n_prefix % CHUNK
    assert list(tmp_path.glob("strata-prompt-*.safetensors"))
    with cached_serving(fam, config) as url:  # a new server on the same directory
        assert complete(url, second) == cold[1]
        assert counter(url, "strata_serve_prompt_cache_hits") == 1
    # A damaged file is refused, and the answer is still the cold one.
    for f in tmp_path.glob("strata-prompt-*.safetensors"):
        data = bytearray(f.read_bytes())
        data[-16] ^= 0x5A
        f.write_bytes(bytes(data))
    with cached_serving(fam, PromptCacheConfig(directory=tmp_path, memory_bytes=0)) as url:
        assert complete(url, second) == cold[1]
        assert counter(url, "strata_serve_prompt_cache_hits") == 0
        assert counter(url, "strata_serve_prompt_cache_refused") >= 1
