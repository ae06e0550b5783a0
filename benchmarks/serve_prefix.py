"""First-token time of a long shared system prompt plus a short question: cold, warm in memory,
warm after a restart (serve's prompt cache, serve/prompt_cache.py).

Each round takes a fresh system prompt of --prefix-tokens token ids and, on a server whose
prompt cache directory is --dir (default: a temporary one):

- cold: the first request (nothing kept: the whole prompt is read);
- warm in memory: the same system prompt, another question, on the same server;
- warm after a restart: a new app instance (an empty memory cache) on the same directory,
  a third question: the prefix comes from the file the first server wrote.

Rounds repeat (--rounds) and the medians and ratios print at the end, with the server's
prompt-cache counters. Time to first token is the client's: from sending the request to the
first streamed token, over HTTP on loopback.

The model is the random checkpoint with Qwen3-30B-A3B's routed experts (benchmarks/
mlx_lm_e2e.py's, over --layers layers, built and converted once into the cache directory), its
experts streamed through an arena of --arena-fraction of them, so reading the prompt costs what
a streamed model's prompt costs: routed experts read and computed for every chunk. --model DIR
serves another mlx-lm model (its pack converted once, as serve does).

    python benchmarks/serve_prefix.py [--prefix-tokens 2000] [--rounds 3] [--layers 4]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

MODEL_ID = "prefix"


def ttft(url: str, prompt: list[int]) -> float:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
    t0 = time.perf_counter()
    stream = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=2,
                                       temperature=0, stream=True)  # fmt: skip
    first = None
    for chunk in stream:
        if first is None and chunk.choices:
            first = time.perf_counter() - t0
    assert first is not None, "no token came back"
    return first


def counters(url: str) -> dict[str, float]:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith("strata_serve_prompt_cache"):
            for s in family.samples:
                if not s.name.endswith("_created"):
                    out[s.name] = s.value
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefix-tokens", type=int, default=2000)
    ap.add_argument("--question-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--arena-fraction", type=float, default=0.5)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--dir", type=Path, default=None, help="prompt cache directory")
    args = ap.parse_args()

    import numpy as np

    from mlx_lm_e2e import default_model, pack_for
    from strata_stream.config import StreamConfig
    from strata_stream.mlx_lm import load
    from strata_stream.pack.reader import ExpertPack
    from strata_stream.serve import BackgroundServer, ServeConfig, create_app
    from strata_stream.serve.prompt_cache import PromptCacheConfig

    model_dir = args.model if args.model is not None else default_model(args.layers)
    pack = pack_for(model_dir)
    with ExpertPack.open(pack) as p:
        g = p.geometry
        arena = max(int(g.n_layers * g.n_experts * p.record_stride * args.arena_fraction),
                    2 * g.top_k * p.record_stride)  # fmt: skip
    model, tok = load(str(model_dir), pack_path=pack, arena_bytes=arena, experts="cpu",
                      config=StreamConfig(direct_io=False, persist_profile=False),
                      progress=False)  # fmt: skip
    vocab = int(getattr(model.args, "vocab_size", 0) or tok.vocab_size)
    rng = np.random.default_rng(0)

    def ids(n: int) -> list[int]:
        return [int(t) for t in rng.integers(3, vocab, n)]

    with tempfile.TemporaryDirectory(prefix="serve_prefix_") as tmp:
        cache_dir = args.dir if args.dir is not None else Path(tmp)
        # The random checkpoint declares a short context; its rotary positions go on.
        context = args.prefix_tokens + args.question_tokens + 8
        config = ServeConfig(model_id=MODEL_ID, prefill_chunk=args.prefill_chunk,
                             context_length=context)  # fmt: skip
        cache = PromptCacheConfig(directory=cache_dir)

        def server() -> Any:
            app = create_app(model, tok, config)
            app.state.worker.configure_prompt_cache(cache)
            return BackgroundServer(app, timeout_s=600)

        times: dict[str, list[float]] = {"cold": [], "warm in memory": [], "after restart": []}
        try:
            with server() as s:  # one unmeasured request: the first call's one-time costs
                ttft(s.url, ids(args.question_tokens + 1))
            for r in range(args.rounds):
                system = ids(args.prefix_tokens)
                with server() as s:
                    times["cold"].append(ttft(s.url, system + ids(args.question_tokens)))
                    times["warm in memory"].append(ttft(s.url, system + ids(args.question_tokens)))
                with server() as s:
                    times["after restart"].append(ttft(s.url, system + ids(args.question_tokens)))
                    seen = counters(s.url)
                print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in
                                                     times.items()), flush=True)  # fmt: skip
        finally:
            model.strata_engine.close()

    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\n{args.prefix_tokens}-token system prompt + {args.question_tokens}-token question, "
          f"{model_dir.name}, arena {args.arena_fraction:.0%} of the experts, prefill chunk "
          f"{args.prefill_chunk}, {args.rounds} rounds (medians)")  # fmt: skip
    print("| first token | median s | cold / this |")
    print("|---|---|---|")
    for k, v in med.items():
        print(f"| {k} | {v:.3f} | {med['cold'] / v:.1f}x |")
    print(f"restarted server's prompt-cache counters (last round): {seen}")


if __name__ == "__main__":
    main()
