"""Serving on the transformers engine: N clients at once against the same N one after another.

    python benchmarks/serve_batch_transformers.py [--layers 2] [--vocab 151936] [--device cpu]
        [--arena-fraction 0.25] [--clients 8] [--tokens 16] [--repeats 3] [--json OUT.json]

The model is benchmarks/transformers_e2e.py's: random qwen3_moe weights with Qwen3-30B-A3B's
dimensions (128 experts of hidden 2048 and moe_intermediate 768, top-8: 1.2 GB of bfloat16
experts a layer) over --layers layers, written once into --workdir and converted once into the
pack cache. It is loaded with strata_stream.transformers.load (bfloat16, on --device) at an
arena of --arena-fraction of all experts, and served in this process (create_app with
max_batch --clients, prefill chunk --prefill-chunk) on a loopback port.

Each client sends one /v1/completions request: a prompt of random token ids (lengths spread
over --prompt-tokens .. 4x, so the batch mixes prompt chunks and decodes), --tokens new tokens
sampled at temperature 1 with the client's own seed (a random model decoding greedily soon
repeats one token and its routing stays on a few experts any arena holds). A warm-up round
(every client, one after another) runs first, untimed. Then, --repeats times, in alternating
order (so neither mode always runs first on a busy machine):
- one after another: each request waits for the previous one's answer;
- together: every client at once, on its own thread.
Throughput is the completion tokens over the wall time of the round; the engine's bytes read
per token come from its stats over the round. Printed: each round, the medians, and the ratio
of the medians (together over one after another). Every client's text must be the same in
every round of either mode (the server promises each client its answer alone, seeded
sampling included): the script says so, or exits 1 naming the client.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: transformers_e2e
from transformers_e2e import QWEN3_30B_A3B, build_checkpoint, pack_for  # noqa: E402


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=3600) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


def bodies(n: int, prompt_tokens: int, tokens: int, vocab: int, seed: int) -> list[dict[str, Any]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = prompt_tokens + (3 * prompt_tokens * i) // max(n - 1, 1)
        ids = [int(t) for t in rng.integers(2, vocab, length)]
        out.append({"model": "m", "prompt": ids, "max_tokens": tokens, "temperature": 1.0,
                    "seed": 1000 + i})  # fmt: skip
    return out


def one_after_another(url: str, reqs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [post(url, b) for b in reqs]


def together(url: str, reqs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[Any] = [None] * len(reqs)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            out[i] = post(url, reqs[i])
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=2, help="decoder layers (1.2 GB of experts each)")
    p.add_argument("--vocab", type=int, default=QWEN3_30B_A3B["vocab_size"],
                   help="vocabulary size (default Qwen3's 151936)")  # fmt: skip
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--arena-fraction", type=float, default=0.25,
                   help="the arena as a share of all experts (default 0.25)")  # fmt: skip
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=16,
                   help="the shortest prompt; the longest is 4x (default 16)")  # fmt: skip
    p.add_argument("--tokens", type=int, default=16, help="new tokens per client (default 16)")
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3, help="rounds of each mode (default 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", type=Path, help="where the checkpoint is written "
                   "(default: the cache's bench/)")  # fmt: skip
    p.add_argument("--json", type=Path, help="write the rounds and the ratio here")
    args = p.parse_args()
    if args.clients < 2 or args.tokens < 1 or args.repeats < 1 or args.layers < 1:
        p.error("--clients >= 2, --tokens >= 1, --repeats >= 1, --layers >= 1")
    if not 0 < args.arena_fraction <= 1:
        p.error("--arena-fraction is a share in (0, 1]")

    import torch
    from transformers import AutoTokenizer

    from strata_stream.pack import ExpertPack
    from strata_stream.paths import cache_dir
    from strata_stream.serve import BackgroundServer, ServeConfig, create_app
    from strata_stream.transformers import load, stats_source

    workdir = args.workdir if args.workdir is not None else cache_dir() / "bench"
    path = workdir / f"hf-qwen3-30b-a3b-shapes-{args.layers}L-v{args.vocab}"
    build_checkpoint(path, args.layers, args.vocab, args.seed)
    pack = pack_for(path)
    with ExpertPack.open(pack) as pk:
        arena = int(args.arena_fraction * pk.geometry.n_records) * pk.record_stride
    model = load(path, pack_path=pack, arena_bytes=arena, device=args.device,
                 dtype=torch.bfloat16, progress=False)  # fmt: skip
    stats = stats_source(model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    reqs = bodies(args.clients, args.prompt_tokens, args.tokens, args.vocab, args.seed)
    config = ServeConfig(model_id="m", max_batch=args.clients, prefill_chunk=args.prefill_chunk)
    rounds: list[dict[str, Any]] = []
    texts: list[str] | None = None
    try:
        app = create_app(model, tokenizer, config, engine="transformers")
        with BackgroundServer(app, timeout_s=600) as server:
            url = server.url
            warm = one_after_another(url, reqs)
            texts = [r["choices"][0]["text"] for r in warm]
            for rep in range(args.repeats):
                order = ["one after another", "together"]
                for mode in order if rep % 2 == 0 else order[::-1]:
                    before = dict(stats())
                    t0 = time.perf_counter()
                    got = (together if mode == "together" else one_after_another)(url, reqs)
                    wall = time.perf_counter() - t0
                    after = dict(stats())
                    n = sum(int(r["usage"]["completion_tokens"]) for r in got)
                    read = (after["bytes_read"] - before["bytes_read"]) / max(n, 1)
                    row = {"mode": mode, "repeat": rep, "seconds": wall, "tokens": n,
                           "tok_s": n / wall, "gb_read_per_token": read / 1e9}  # fmt: skip
                    rounds.append(row)
                    print(f"{mode:>17}: {n} tokens in {wall:7.2f} s = {n / wall:7.2f} tok/s, "
                          f"{read / 1e9:.3f} GB read/token", flush=True)  # fmt: skip
                    for i, r in enumerate(got):
                        if r["choices"][0]["text"] != texts[i]:
                            print(f"client {i}'s text differs in a {mode} round", flush=True)
                            return 1
    finally:
        model.strata_engine.close()
    seq = statistics.median(r["tok_s"] for r in rounds if r["mode"] == "one after another")
    tog = statistics.median(r["tok_s"] for r in rounds if r["mode"] == "together")
    print(f"device {args.device}, {args.layers} layers, arena {args.arena_fraction:g} of the "
          f"experts, {args.clients} clients x {args.tokens} tokens, "
          f"{args.repeats} rounds each")  # fmt: skip
    print(f"median tok/s: one after another {seq:.2f}, together {tog:.2f}; "
          f"ratio together / one after another = {tog / seq:.2f}")  # fmt: skip
    print("every client's text was the same in every round of both modes")
    if args.json is not None:
        record = {"args": {k: str(v) for k, v in vars(args).items()}, "rounds": rounds,
                  "ratio": tog / seq}  # fmt: skip
        args.json.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
