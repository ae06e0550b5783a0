"""`strata-stream generate MODEL --prompt TEXT`: text as it is generated, then the engine's figures.

Prompt and decode are reported apart: the Window's counters are snapshotted when the first
token arrives (the prompt pass is done by then) and again at the end.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

from strata_stream.config import StreamConfig
from strata_stream.engine_choice import Lines, mlx_lm_cannot_build
from strata_stream.errors import ConfigError
from strata_stream.units import human_bytes

DEFAULT_MAX_TOKENS = 100
_COUNTERS = ("tokens", "hits", "misses", "bytes_read", "stall_seconds", "pred_correct",
             "pred_actual")  # fmt: skip


def _delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, float]:
    return {k: float(after[k]) - float(before.get(k, 0)) for k in _COUNTERS}


def _line(name: str, d: dict[str, float], tokens: int, tps: float) -> str:
    looked = d["hits"] + d["misses"]
    hit = f"{d['hits'] / looked:.1%}" if looked else "n/a"
    recall = f"{d['pred_correct'] / d['pred_actual']:.1%}" if d["pred_actual"] else "n/a"
    stall = d["stall_seconds"] / tokens * 1e3 if tokens else 0.0
    return (
        f"{name:<7} {tokens} tokens, {tps:.2f} tok/s, hit rate {hit}, "
        f"{human_bytes(d['bytes_read'])} read on a miss, stall {stall:.2f} ms/token, "
        f"prediction recall {recall}"
    )


def arena_bytes(engine: Any) -> int:
    """The expert arena this engine holds: its slots times the record stride."""
    return int(engine.stream.n_slots * engine.stream.record_stride)


def peak_memory(engine: Any | None) -> str:
    """Peak memory, said with what it counts: MLX's own peak allocation (dense weights, KV
    cache, activations) plus the expert arena, which the engine allocates outside MLX."""
    import mlx.core as mx

    mlx_peak = mx.get_peak_memory()
    arena = arena_bytes(engine) if engine is not None else 0
    return (
        f"peak memory {human_bytes(mlx_peak + arena)} (MLX's peak {human_bytes(mlx_peak)} + "
        f"the expert arena {human_bytes(arena)})"
    )


def prompt_tokens(tokenizer: Any, prompt: str) -> list[int]:
    """The prompt's token ids, encoded as mlx_lm.stream_generate encodes a string."""
    bos = getattr(tokenizer, "bos_token", None)
    add_special = bos is None or not prompt.startswith(bos)
    return list(tokenizer.encode(prompt, add_special_tokens=add_special))


def token_budget(model: Any, n_prompt: int, max_tokens: int | None) -> int:
    """Tokens to generate after a prompt of `n_prompt` tokens, refused as the server refuses a
    request (serve/app.py): an empty prompt, or a prompt plus --max-tokens beyond the model's
    context (max_position_embeddings). Without --max-tokens: 100, or what the context leaves."""
    if n_prompt == 0:
        raise ConfigError("the prompt is empty (it encodes to no tokens)")
    if max_tokens is not None and max_tokens < 1:
        raise ConfigError(f"--max-tokens must be at least 1, got {max_tokens}")
    ctx = getattr(getattr(model, "args", None), "max_position_embeddings", None)
    ctx = ctx if isinstance(ctx, int) and ctx > 0 else None
    if ctx is not None and n_prompt >= ctx:
        raise ConfigError(
            f"the model's maximum context length is {ctx} tokens, and the prompt is {n_prompt}"
        )
    if max_tokens is None:
        return DEFAULT_MAX_TOKENS if ctx is None else min(DEFAULT_MAX_TOKENS, ctx - n_prompt)
    if ctx is not None and n_prompt + max_tokens > ctx:
        raise ConfigError(
            f"--max-tokens {max_tokens} is beyond the model's maximum context length of {ctx} "
            f"tokens: the prompt takes {n_prompt}, so at most {ctx - n_prompt} can be generated"
        )
    return max_tokens


def generate(
    model_path: str,
    prompt: str,
    *,
    max_tokens: int | None = None,
    arena_gb: float | None = None,
    experts: str = "cpu",
    arithmetic: str = "auto",
    pack_path: str | None = None,
    out: TextIO | None = None,
) -> dict[str, Any]:
    """Generates greedily with streamed experts, printing as it goes (to `out`, default the
    sys.stdout of the moment); returns the figures."""
    out = sys.stdout if out is None else out
    from mlx_lm.generate import stream_generate

    from strata_stream.mlx_lm.loader import load

    arena = None if arena_gb is None else int(arena_gb * (1 << 30))
    try:
        model, tokenizer = load(model_path, arena_bytes=arena, pack_path=pack_path,
                                experts=experts, arithmetic=arithmetic,
                                config=StreamConfig.from_env())  # fmt: skip
    except Exception as e:
        unreadable = mlx_lm_cannot_build(e, model_path)
        if unreadable is None:
            raise
        raise unreadable from e
    engine = model.strata_engine
    try:
        ids = prompt_tokens(tokenizer, prompt)
        budget = token_budget(model, len(ids), max_tokens)
        window = engine.window
        start = window.stats()["total"]
        at_first: dict[str, Any] | None = None
        last = None
        with Lines(out) as text:  # an error mid-text starts on a line of its own
            for r in stream_generate(model, tokenizer, ids, max_tokens=budget):
                if at_first is None:
                    at_first = window.stats()["total"]
                text.write(r.text)
                text.flush()
                last = r
        out.write("\n")
        end = window.stats()["total"]
        if last is None or at_first is None:
            return {}
        prompt_d = _delta(at_first, start)
        decode_d = _delta(end, at_first)
        # The first token's own pass counts with the prompt: decode is every later token.
        decode_tokens = max(0, last.generation_tokens - 1)
        print(_line("prompt", prompt_d, last.prompt_tokens, last.prompt_tps), file=out)
        print(_line("decode", decode_d, decode_tokens, last.generation_tps), file=out)
        # The Window counts the reads its calls waited for (misses); the stream counts every
        # read, the speculative ones (predictions, the profile's head start) too.
        total_read = human_bytes(engine.stream.stats()["bytes_read"])
        print(f"arena   {human_bytes(arena_bytes(engine))}, {engine.stream.n_slots} expert "
              f"slots, experts on {engine.experts}, {total_read} read in all (prefetch "
              f"included), {peak_memory(engine)}", file=out)  # fmt: skip
        return {"prompt": prompt_d, "decode": decode_d, "prompt_tps": last.prompt_tps,
                "generation_tps": last.generation_tps}  # fmt: skip
    finally:
        engine.close()


def generate_distributed(
    model_path: str,
    prompt: str,
    *,
    mode: str,
    max_tokens: int | None = None,
    arena_gb: float | None = None,
    experts: str = "cpu",
    arithmetic: str = "auto",
    out: TextIO | None = None,
) -> dict[str, Any]:
    """`generate --pipeline|--tensor` under mlx.launch: every rank loads its share and runs the
    same greedy steps; rank 0 prints the text, every rank's figures and their sum, the others
    print nothing. Returns this rank's figures and the per-rank list."""
    import io

    from mlx_lm.generate import stream_generate

    from strata_stream.mlx_lm.distributed import SUMMED, gather_stats, load_split, rank_stats

    arena = None if arena_gb is None else int(arena_gb * (1 << 30))
    model, tokenizer, group = load_split(
        model_path,
        mode,
        arena_bytes=arena,
        experts=experts,
        arithmetic=arithmetic,
        config=StreamConfig.from_env(),
    )
    rank = group.rank()
    say = (sys.stdout if out is None else out) if rank == 0 else io.StringIO()
    engine = model.strata_engine
    try:
        ids = prompt_tokens(tokenizer, prompt)
        budget = token_budget(model, len(ids), max_tokens)
        last = None
        for r in stream_generate(model, tokenizer, ids, max_tokens=budget):
            say.write(r.text)
            say.flush()
            last = r
        say.write("\n")
        mine = rank_stats(model)
        ranks = gather_stats(mine, group)
        for i, st in enumerate(ranks):
            looked = st["hits"] + st["misses"]
            hit = f"{st['hits'] / looked:.1%}" if looked else "n/a"
            print(f"rank {i}  hit rate {hit}, {human_bytes(st['bytes_read'])} read, "
                  f"{st['misses']} expert reads", file=say)  # fmt: skip
        total = {k: sum(st[k] for st in ranks) for k in SUMMED}
        print(f"all {len(ranks)}  {human_bytes(total['bytes_read'])} read, {total['misses']} "
              f"expert reads", file=say)  # fmt: skip
        if last is not None:
            print(f"decode  {last.generation_tokens} tokens, {last.generation_tps:.2f} tok/s "
                  f"(rank 0), {peak_memory(engine)}", file=say)  # fmt: skip
        return {"rank": rank, "stats": mine, "ranks": ranks,
                "generation_tps": 0.0 if last is None else last.generation_tps}  # fmt: skip
    finally:
        if engine is not None:
            engine.close()
