"""How long running streams stall while another client sends a prompt far beyond the context.

Two clients stream (greedy, the tiny chat checkpoint as plain mlx-lm loads it: the stall is
the server's, whatever runs the experts); once both decode, a third sends one oversized body: a
10 MB text prompt (/v1/completions), the same as a chat message, 3.5 M token ids, or 350,000
one-word chat messages. The server must refuse each (400, context_length_exceeded) without
holding up the streams: it refuses a text by its first characters' tokens without tokenizing
it whole and too many messages by their count before validating them, parses the body off the
event loop, and tokenizes with tokenizers of its own, never the one the batch detokenizes with
(serve/tokenizing.py).
Reported per body: the answer's status and time, and the streaming clients' longest
inter-token gap while it was in flight, against their median gap.

    python benchmarks/serve_hostile_prompt.py [--mb 10] [--ids 3500000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from common import stream_gaps

MODEL_ID = "hostile"


def post(url: str, body: bytes) -> int:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            r.read()
            return int(r.status)
    except urllib.error.HTTPError as e:
        e.read()
        return int(e.code)


def run(model: Any, tok: Any, name: str, route: str, body: bytes) -> dict[str, Any]:
    import openai

    from strata_stream.serve import BackgroundServer, ServeConfig, create_app

    app = create_app(model, tok, ServeConfig(model_id=MODEL_ID))
    gaps: list[list[tuple[float, float]]] = [[], []]
    decoding = threading.Barrier(3)
    answered = threading.Event()  # the streams hang up soon after the answer
    with BackgroundServer(app) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                               timeout=600)  # fmt: skip

        def decode(i: int) -> None:
            def stop(now: float) -> bool:  # well past the hostile body's answer
                return answered.is_set() and len(gaps[i]) > 50 and now > gaps[i][-50][0] + 0.2

            stream_gaps(client, MODEL_ID, i, 2000, decoding, gaps[i], stop)

        threads = [threading.Thread(target=decode, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        decoding.wait()
        t0 = time.perf_counter()
        status = post(server.url + route, body)
        t1 = time.perf_counter()
        answered.set()
        for t in threads:
            t.join()
    during = [g for gs in gaps for (at, g) in gs if t0 <= at <= t1 + 0.05]
    every = [g for gs in gaps for (_, g) in gs]
    return {
        "body": name,
        "status": status,
        "answer_s": round(t1 - t0, 2),
        "max_gap_ms": round(1e3 * max(during, default=0.0), 1),
        "gap_p50_ms": round(1e3 * statistics.median(every), 2),
        "finished_during": not during,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=10.0, help="megabytes of prompt text")
    ap.add_argument("--ids", type=int, default=3_500_000, help="token ids in the id prompt")
    args = ap.parse_args()

    import mlx_lm

    from strata_stream.mlx_lm.random_model import make_chat_checkpoint

    text = "the water is hot " * int(args.mb * 1e6 / 17)
    bodies = [
        ("text prompt", "/v1/completions", {"model": MODEL_ID, "prompt": text}),
        ("chat message", "/v1/chat/completions",
         {"model": MODEL_ID, "messages": [{"role": "user", "content": text}]}),
        ("token ids", "/v1/completions", {"model": MODEL_ID, "prompt": [5] * args.ids}),
        ("one-word messages", "/v1/chat/completions",
         {"model": MODEL_ID, "messages": [{"role": "user", "content": "a"}] * (args.ids // 10)}),
    ]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="hostile_") as tmp:
        model, tok = mlx_lm.load(str(make_chat_checkpoint(Path(tmp) / "tiny")))
        print("| body | bytes | status | answered in s | streams' max gap ms | gap p50 ms |")
        print("|---|---|---|---|---|---|")
        for name, route, obj in bodies:
            raw = json.dumps(obj).encode()
            r = run(model, tok, name, route, raw)
            gap = "(streams ended first)" if r["finished_during"] else r["max_gap_ms"]
            print(f"| {name} | {len(raw)} | {r['status']} | {r['answer_s']} | {gap} | "
                  f"{r['gap_p50_ms']} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
