"""The decode stall a long prompt causes, against the server's --prefill-chunk.

Two clients stream (greedy, the tiny checkpoint with its experts streamed through a quarter
arena); once both decode, a third request brings a prompt of --prompt-tokens tokens. Each step
of the continuous batch decodes one token for every generating request and then prefills at
most prefill_chunk prompt tokens, so the decoding clients' longest inter-token gap while the
long prompt is read is the stall one chunk costs. Reported per chunk size: that longest gap,
the clients' median gap, and the long request's time to first token.

    python benchmarks/serve_prefill_stall.py [--chunks 32,128,512,4096] [--prompt-tokens 2000]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from common import stream_gaps

MODEL_ID = "stall"


def run(model: Any, tok: Any, chunk: int, prompt_tokens: int) -> dict[str, float]:
    import openai

    from strata_stream.serve import BackgroundServer, ServeConfig, create_app

    app = create_app(model, tok, ServeConfig(model_id=MODEL_ID, prefill_chunk=chunk))
    long_prompt = " ".join(["the water is hot"] * (prompt_tokens // 4))
    gaps: list[list[tuple[float, float]]] = [[], []]
    decoding = threading.Barrier(3)
    with BackgroundServer(app) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)

        def decode(i: int) -> None:
            stream_gaps(client, MODEL_ID, i, 400, decoding, gaps[i])

        threads = [threading.Thread(target=decode, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        decoding.wait()
        t0 = time.perf_counter()
        stream = client.chat.completions.create(
            model=MODEL_ID, messages=[{"role": "user", "content": long_prompt}], max_tokens=4,
            temperature=0, stream=True,
        )  # fmt: skip
        ttft = None
        for c in stream:
            if ttft is None and c.choices and c.choices[0].delta.content:
                ttft = time.perf_counter()
        for t in threads:
            t.join()
    assert ttft is not None
    during = [g for gs in gaps for (at, g) in gs if t0 <= at <= ttft + 0.05]
    every = [g for gs in gaps for (_, g) in gs]
    return {
        "prefill_chunk": chunk,
        "stall_ms": round(1e3 * max(during, default=0.0), 1),
        "gap_p50_ms": round(1e3 * statistics.median(every), 2),
        "long_ttft_s": round(ttft - t0, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", default="32,128,512,4096")
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    args = ap.parse_args()

    from strata_stream.config import StreamConfig
    from strata_stream.convert import convert
    from strata_stream.mlx_lm import load
    from strata_stream.mlx_lm.random_model import make_chat_checkpoint
    from strata_stream.pack.reader import ExpertPack

    with tempfile.TemporaryDirectory(prefix="stall_") as tmp:
        path = make_chat_checkpoint(Path(tmp) / "tiny")
        pack = convert(path, Path(tmp) / "experts.strpk", progress=False)
        with ExpertPack.open(pack) as p:
            arena = max(p.geometry.n_records * p.record_stride // 4,
                        2 * p.geometry.top_k * p.record_stride)  # fmt: skip
        model, tok = load(str(path), pack_path=pack, arena_bytes=arena, experts="cpu",
                          config=StreamConfig(direct_io=False, persist_profile=False),
                          progress=False)  # fmt: skip
        try:
            print("| prefill_chunk | decode stall (max gap) ms | gap p50 ms | long prompt TTFT s |")
            print("|---|---|---|---|")
            for chunk in (int(x) for x in args.chunks.split(",")):
                r = run(model, tok, chunk, args.prompt_tokens)
                print(f"| {r['prefill_chunk']} | {r['stall_ms']} | {r['gap_p50_ms']} | "
                      f"{r['long_ttft_s']} |", flush=True)  # fmt: skip
        finally:
            model.strata_engine.close()


if __name__ == "__main__":
    main()
