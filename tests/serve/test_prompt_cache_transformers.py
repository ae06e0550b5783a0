"""Prompt caches on the transformers engine (serve/prompt_cache_torch.py): a streamed model's
answer to a prompt that starts with a kept prefix (in memory, then from the file after a
restart) is bitwise its answer from a server that keeps no cache, tokens and log-probabilities;
a damaged file is refused."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: the families module
from serve.helpers import TIMEOUT_S, scrape  # noqa: E402
from serve.test_errors import post  # noqa: E402
from serve.tool_model import save_word_tool_tokenizer  # noqa: E402
from strata_stream.serve import BackgroundServer, ServeConfig, create_app  # noqa: E402
from strata_stream.serve.prompt_cache import PromptCacheConfig  # noqa: E402
from test_transformers_families import Family  # noqa: E402

MODEL_ID = "tiny-hf-qwen3-moe"
CHUNK = 32


@pytest.fixture(scope="module")
def fam(tmp_path_factory: pytest.TempPathFactory) -> Family:
    f = Family("qwen3_moe", tmp_path_factory.mktemp("serve_hf_prompt_cache"), "float32")
    save_word_tool_tokenizer(f.path)
    return f


@pytest.fixture(scope="module")
def prompts(fam: Family) -> tuple[list[int], list[int], int]:
    vocab = transformers.AutoTokenizer.from_pretrained(fam.path).vocab_size
    rng = np.random.default_rng(37)
    prefix = [int(t) for t in rng.integers(3, vocab, 150)]
    return (prefix + [int(t) for t in rng.integers(3, vocab, 9)],
            prefix + [int(t) for t in rng.integers(3, vocab, 5)], len(prefix))  # fmt: skip


@contextmanager
def serving(fam: Family, cache: PromptCacheConfig | None) -> Iterator[str]:
    model = fam.load(slots=fam.n_records // 4)
    tokenizer = transformers.AutoTokenizer.from_pretrained(fam.path)
    try:
        app = create_app(model, tokenizer, ServeConfig(model_id=MODEL_ID, prefill_chunk=CHUNK),
                         engine="transformers")  # fmt: skip
        app.state.worker.configure_prompt_cache(cache)
        with BackgroundServer(app, timeout_s=TIMEOUT_S) as server:
            yield server.url
    finally:
        model.strata_engine.close()


def complete(url: str, prompt: list[int]) -> tuple[str, list[Any], list[Any]]:
    body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": 6, "temperature": 0,
            "logprobs": 3}  # fmt: skip
    status, answer = post(url + "/v1/completions", json.dumps(body).encode())
    assert status == 200, answer
    c = answer["choices"][0]
    return c["text"], c["logprobs"]["token_logprobs"], c["logprobs"]["top_logprobs"]


def counter(url: str, name: str) -> float:
    samples = scrape(url)
    return samples.get(name + "_total", samples.get(name, -1.0))


def test_a_kept_prefix_answers_bitwise_as_cold_in_memory_and_after_a_restart(
    fam: Family, prompts: tuple[list[int], list[int], int], tmp_path: Path
) -> None:
    first, second, n_prefix = prompts
    with serving(fam, None) as url:
        cold = [complete(url, first), complete(url, second)]
    config = PromptCacheConfig(directory=tmp_path)
    with serving(fam, config) as url:
        assert complete(url, first) == cold[0]
        assert complete(url, second) == cold[1]  # warm in memory
        assert counter(url, "strata_serve_prompt_cache_hits") == 1
        # Whole prefill chunks of the prefix: what a cold read computed in the same calls.
        assert counter(url, "strata_serve_prompt_cache_tokens") == n_prefix - n_prefix % CHUNK
    assert list(tmp_path.glob("strata-prompt-*.safetensors"))
    with serving(fam, config) as url:  # a new server on the same directory
        assert complete(url, second) == cold[1]
        assert counter(url, "strata_serve_prompt_cache_hits") == 1
    # A damaged file is refused, and the answer is still the cold one.
    for f in tmp_path.glob("strata-prompt-*.safetensors"):
        data = bytearray(f.read_bytes())
        data[-16] ^= 0x5A
        f.write_bytes(bytes(data))
    with serving(fam, PromptCacheConfig(directory=tmp_path, memory_bytes=0)) as url:
        assert complete(url, second) == cold[1]
        assert counter(url, "strata_serve_prompt_cache_hits") == 0
        assert counter(url, "strata_serve_prompt_cache_refused") >= 1
