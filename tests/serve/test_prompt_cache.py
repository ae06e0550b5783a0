"""Prompt caches kept across requests and restarts (serve/prompt_cache.py) on the mlx-lm
engine: a prompt that starts with a kept prefix reads only the rest, and its tokens and
log-probabilities are bitwise those of a server that keeps no cache; files of another model, a
corrupted or truncated file are refused (never loaded, never a crash); the size bound holds;
a user's own files are never touched."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlx_lm
import numpy as np
import pytest

from serve.harness import load_streamed, quarter_arena, serving
from serve.helpers import MODEL_ID, complete_scored, counter
from strata_stream.mlx_lm.random_model import make_chat_checkpoint
from strata_stream.serve import ServeConfig
from strata_stream.serve.prompt_cache import MARK, PromptCacheConfig, read_metadata

# Several prefill chunks (64 tokens each), so a kept prefix ends inside a chunk of a cold read.
CHUNK = 64
rng = np.random.default_rng(37)
PREFIX = [int(t) for t in rng.integers(3, 120, 300)]
FIRST = PREFIX + [int(t) for t in rng.integers(3, 120, 11)]
SECOND = PREFIX + [int(t) for t in rng.integers(3, 120, 7)]


@contextmanager
def cached_serving(path: Path, cache: PromptCacheConfig | None) -> Iterator[str]:
    model, tokenizer = mlx_lm.load(str(path))[:2]
    config = ServeConfig(model_id=MODEL_ID, prefill_chunk=CHUNK)
    with serving(model, tokenizer, config, prompt_cache=cache) as server:
        yield server.url


def complete(url: str, prompt: list[int]) -> tuple[str, Any, Any]:
    """Greedy text, the sampled tokens' log-probabilities and the top 3 at each, as served."""
    return complete_scored(url, prompt, 8)


def ours(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if p.name.startswith("strata-prompt-"))


@pytest.fixture(scope="module")
def cold(tiny_path: Path) -> dict[int, tuple[str, list[Any], list[Any]]]:
    """Every prompt's answer from a server that keeps no prompt cache."""
    with cached_serving(tiny_path, None) as url:
        return {i: complete(url, p) for i, p in enumerate((FIRST, SECOND))}


def test_a_kept_prefix_answers_bitwise_as_cold_in_memory_and_after_a_restart(
    tiny_path: Path, cold: dict[int, Any], tmp_path: Path
) -> None:
    config = PromptCacheConfig(directory=tmp_path)
    with cached_serving(tiny_path, config) as url:
        assert complete(url, FIRST) == cold[0]
        assert counter(url, "strata_serve_prompt_cache_misses") == 1
        assert complete(url, SECOND) == cold[1]  # warm in memory
        assert counter(url, "strata_serve_prompt_cache_hits") == 1
        assert counter(url, "strata_serve_prompt_cache_tokens") == len(PREFIX)
        assert counter(url, "strata_serve_prompt_cache_bytes") > 0
    assert ours(tmp_path)
    with cached_serving(tiny_path, config) as url:  # a new server on the same directory
        assert complete(url, SECOND) == cold[1]
        assert counter(url, "strata_serve_prompt_cache_hits") == 1  # from the file
        assert counter(url, "strata_serve_prompt_cache_tokens") >= len(PREFIX)
        assert counter(url, "strata_serve_prompt_cache_disk_bytes") > 0


def test_a_file_of_another_model_is_refused_and_left_alone(
    tiny_path: Path, cold: dict[int, Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    other = make_chat_checkpoint(tmp_path / "other", seed=5)
    d = tmp_path / "caches"
    with cached_serving(other, PromptCacheConfig(directory=d)) as url:
        complete(url, FIRST)
    (theirs,) = ours(d)
    before = (theirs.read_bytes(), theirs.stat().st_mtime_ns)
    caplog.set_level(logging.INFO, logger="strata_stream.serve")
    with cached_serving(tiny_path, PromptCacheConfig(directory=d, memory_bytes=0)) as url:
        assert complete(url, SECOND) == cold[1]
        assert counter(url, "strata_serve_prompt_cache_hits") == 0
    assert "belong to another model" in caplog.text
    assert (theirs.read_bytes(), theirs.stat().st_mtime_ns) == before


@pytest.mark.parametrize("damage", ["corrupted", "truncated"])
def test_a_damaged_file_is_refused_never_loaded(
    tiny_path: Path, cold: dict[int, Any], tmp_path: Path, damage: str
) -> None:
    config = PromptCacheConfig(directory=tmp_path, memory_bytes=0)
    with cached_serving(tiny_path, config) as url:
        complete(url, FIRST)
    (f,) = ours(tmp_path)
    data = bytearray(f.read_bytes())
    if damage == "corrupted":  # the header stays readable; a tensor's bytes change
        data[-64] ^= 0x5A
        f.write_bytes(bytes(data))
    else:
        f.write_bytes(bytes(data[: len(data) * 2 // 3]))
    with cached_serving(tiny_path, config) as url:
        assert complete(url, SECOND) == cold[1]
        assert counter(url, "strata_serve_prompt_cache_hits") == 0
        assert counter(url, "strata_serve_prompt_cache_refused") == 1


def test_the_size_bound_holds_and_a_users_files_are_never_touched(
    tiny_path: Path, tmp_path: Path
) -> None:
    mine = tmp_path / "notes.safetensors"
    mine.write_bytes(b"a user's own file")
    named_like_ours = tmp_path / ("strata-prompt-" + "0" * 16 + "-" + "1" * 16 + "-" + "2" * 16
                                  + ".safetensors")  # fmt: skip
    named_like_ours.write_bytes(b"no header of ours")
    # A staging directory a killed writer left, and a user's directory shaped like one.
    left = tmp_path / f".{named_like_ours.name}.{'a' * 32}.staging"
    left.mkdir()
    (left / named_like_ours.name).write_bytes(b"half a cache")
    users = tmp_path / f".notes.{'b' * 32}.staging"
    users.mkdir()
    with cached_serving(tiny_path, PromptCacheConfig(directory=tmp_path)) as url:
        complete(url, FIRST)
    (first,) = [p for p in ours(tmp_path) if p != named_like_ours]
    assert not left.exists() and users.exists()
    bound = int(first.stat().st_size * 1.5)
    with cached_serving(tiny_path, PromptCacheConfig(directory=tmp_path, disk_bytes=bound)) as url:
        for i in range(5):
            complete(url, [int(t) for t in rng.integers(3, 120, 120 + 10 * i)])
            written = [p for p in ours(tmp_path) if p != named_like_ours]
            assert sum(p.stat().st_size for p in written) <= bound
        assert first not in written and 0 < len(written) < 5  # the least recently used went
    assert mine.read_bytes() == b"a user's own file"
    assert named_like_ours.read_bytes() == b"no header of ours"
    for p in written:
        meta = read_metadata(p)
        assert meta is not None and meta["mark"] == MARK
    assert os.listdir(tmp_path)  # nothing else was emptied


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--prompt-cache-gb", "-1"], "--prompt-cache-gb must be a size >= 0, got -1"),
        (["--prompt-cache-memory-gb", "lots"], "--prompt-cache-memory-gb: cannot read 'lots'"),
        (["--prompt-cache-dir", "/proc/no/such"], "--prompt-cache-dir /proc/no/such:"),
    ],
)
def test_a_prompt_cache_option_mistake_is_one_line(
    tiny_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], says: str
) -> None:
    from strata_stream.cli import main

    assert main(["serve", str(tiny_path), "--port", "0", *flags]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1


def test_a_streamed_model_answers_bitwise_from_a_kept_prefix(
    tiny_path: Path, tiny_pack: Path, tmp_path: Path
) -> None:
    """The experts computed by the engine's own CPU kernels over a quarter arena: a kept
    prefix gives the cold answer to the bit, in memory and from the file after a restart."""
    arena = quarter_arena(tiny_pack)

    @contextmanager
    def streamed(cache: PromptCacheConfig | None) -> Iterator[str]:
        model, tok = load_streamed(tiny_path, tiny_pack, arena_bytes=arena)
        config = ServeConfig(model_id=MODEL_ID, prefill_chunk=CHUNK)
        with serving(model, tok, config, prompt_cache=cache, close_engine=True) as server:
            yield server.url

    with streamed(None) as url:
        cold = complete(url, SECOND)
    config = PromptCacheConfig(directory=tmp_path / "caches")
    with streamed(config) as url:
        complete(url, FIRST)
        assert complete(url, SECOND) == cold
        assert counter(url, "strata_serve_prompt_cache_hits") == 1
    with streamed(config) as url:
        assert complete(url, SECOND) == cold
        assert counter(url, "strata_serve_prompt_cache_hits") == 1


def test_a_prefix_kept_from_a_batch_answers_bitwise_as_cold(
    tiny_path: Path, cold: dict[int, Any], tmp_path: Path
) -> None:
    """A cache the generator hands back from a batch of several sequences (of other lengths,
    so padded) serves the next request as a lone one's would."""
    from concurrent.futures import ThreadPoolExecutor

    others = [[int(t) for t in rng.integers(3, 120, n)] for n in (40, 350, 90)]
    with cached_serving(tiny_path, PromptCacheConfig(directory=tmp_path)) as url:
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda p: complete(url, p), [FIRST, *others]))
        assert answers[0] == cold[0]
        assert complete(url, SECOND) == cold[1]
        assert counter(url, "strata_serve_prompt_cache_tokens") >= len(PREFIX)


def test_the_apps_own_config_keeps_the_cache_an_embedder_asks_for(
    tiny_path: Path, tmp_path: Path
) -> None:
    """create_app applies ServeConfig's prompt-cache settings itself: an embedder that never
    calls configure_prompt_cache gets the directory it named."""
    model, tokenizer = mlx_lm.load(str(tiny_path))[:2]
    config = ServeConfig(model_id=MODEL_ID, prefill_chunk=CHUNK, prompt_cache_dir=str(tmp_path))
    with serving(model, tokenizer, config) as server:
        complete(server.url, FIRST)
    assert ours(tmp_path), "no prompt cache file was written in the configured directory"
