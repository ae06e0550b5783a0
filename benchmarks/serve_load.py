"""Load test of `strata-stream serve`: N concurrent streaming chat clients for T seconds.

    python benchmarks/serve_load.py [--model DIR | --url http://127.0.0.1:PORT]
        [--routing trace|model] [--arena-fraction 0.25] [--clients 1,2,4,8,16] [--seconds 60]
        [--repeats 2] [--max-tokens 32] [--max-batch 1,8] [--client raw|openai] [--json OUT]
        [--plot PNG]

Without --url it starts the server itself as a subprocess on a free loopback port (this
script's --serve-child: `strata-stream serve`'s own steps, plus the routing below), on --model
or on a small random-weight qwen3_moe checkpoint built once into a temporary directory, and
stops it at the end. Levels run interleaved (1,4,8,1,4,8 with --repeats 2) so drift on a
shared machine hits every level alike. --max-batch runs the levels once per value, each on its
own server (`serve --max-batch B`): 1 is one request at a time, so "1,8" compares serving one
at a time with batching.

Routing: a random model routes concentrated (a few experts win every token), which flatters
batching. `--routing trace` (the default without --model) builds the checkpoint with the real
trace's geometry (128 experts, top-6; 8 layers, tiny attention) and makes its blocks choose
their experts from tests/data's Qwen3-30B-A3B routing trace (strata_stream.trace.routing: each
token takes the experts of one trace token, layer for layer), so a batch's rows share experts
as a real model's tokens do; its experts stream through an arena of --arena-fraction of them.
`--routing model` keeps the model's own gates (the old tiny checkpoint without --model).
`--dense` picks the trace model's weights: float32 (the default) or q4 (g64, as mlx-lm
quantizes). On Linux, MLX's CPU quantized matmul costs in proportion to the rows (a 64x64 q4
Linear: 28 us at 1 row, 186 us at 8), which no GPU kernel of the design point does; float32
dense layers run through BLAS and, like a GPU's, cost about the same at 1 and 8 rows, so the
batched figures measure the server and the engine rather than that CPU kernel. q4 is the
comparison (`benchmarks/batch_step.py` splits a step into MLX's work and ours).

Clients: every client is a thread of this process, on the same machine as the server, so
what a client costs is taken from the server's cores. The default `--client raw` reads the SSE
stream with http.client and one json.loads a chunk (0.07 ms of CPU a token, measured at 8
clients on the 2-core test machine); `--client openai`, the real `openai` client (httpx and a
pydantic model a chunk), costs 0.44 ms a token there. The serve tests use the real `openai`
client.

Per level: completed requests, generated tokens/s, time to first token and inter-token gap
(p50/p99, as each client sees them), errors (must be 0), experts looked up and read from the
pack per generated token (from the server's /metrics: a decode step looks its rows' union up
once), and the server's RSS before and after. Then the ratios against issue 19's targets.
Every client loop is bounded by the deadline and by --max-requests; only loopback is allowed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import require_matplotlib

PROMPTS = [
    "hello world how are you",
    "the water is hot",
    "a model of the arena",
    "you can write what you see",
    "tell me about the expert stream",
    "each layer has a cache",
    "when will the token come",
    "people like to call their water",
]
LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}
TRACE = Path(__file__).resolve().parents[1] / "tests" / "data" / "qwen3-30b-a3b.route.csv"
# The trace's geometry (Qwen3-30B-A3B as traced: 128 experts, top-6), 8 layers spread over its
# 48, everything else tiny so that the 2-core machine runs every level in seconds.
TRACE_DIMS = {"num_hidden_layers": 8, "num_experts": 128, "num_experts_per_tok": 6,
              "max_position_embeddings": 8192}  # fmt: skip
# Read from the server's /metrics before and after each level.
ENGINE_COUNTERS = (
    "strata_expert_hits_total",
    "strata_expert_misses_total",
    "strata_expert_bytes_read_total",
    "strata_serve_generated_tokens_total",
)


@dataclass
class Level:
    clients: int
    repeat: int
    seconds: float
    max_batch: int = 0  # the server's --max-batch (0: not started here)
    requests: int = 0
    errors: int = 0
    tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    gaps_s: list[float] = field(default_factory=list)
    rss_start_mb: float = 0.0
    rss_end_mb: float = 0.0
    engine: dict[str, float] = field(default_factory=dict)  # counter deltas over the level
    error_samples: list[str] = field(default_factory=list)

    def per_token(self, *names: str) -> float:
        tokens = self.engine.get("strata_serve_generated_tokens_total", 0.0)
        if not tokens or not all(n in self.engine for n in names):
            return float("nan")
        return sum(self.engine[n] for n in names) / tokens

    def summary(self) -> dict[str, float | int]:
        return {
            "max_batch": self.max_batch,
            "clients": self.clients,
            "repeat": self.repeat,
            "seconds": round(self.seconds, 2),
            "requests": self.requests,
            "errors": self.errors,
            "tokens": self.tokens,
            "tokens_per_s": round(self.tokens / self.seconds, 1),
            "requests_per_s": round(self.requests / self.seconds, 2),
            "ttft_p50_ms": round(1e3 * pct(self.ttft_s, 50), 1),
            "ttft_p99_ms": round(1e3 * pct(self.ttft_s, 99), 1),
            "token_p50_ms": round(1e3 * pct(self.gaps_s, 50), 2),
            "token_p99_ms": round(1e3 * pct(self.gaps_s, 99), 2),
            "experts_looked_up_per_token": round(
                self.per_token("strata_expert_hits_total", "strata_expert_misses_total"), 2
            ),
            "experts_read_per_token": round(self.per_token("strata_expert_misses_total"), 2),
            "rss_start_mb": round(self.rss_start_mb, 1),
            "rss_end_mb": round(self.rss_end_mb, 1),
        }


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def serve_child(args: argparse.Namespace) -> None:
    """The server subprocess: `strata-stream serve`'s steps (bind first, load, serve in the
    foreground until SIGTERM), with the routing replaced by the trace's when asked."""
    from strata_stream.serve import ServeConfig, create_app
    from strata_stream.serve.loader import load_for_serving
    from strata_stream.serve.server import listen, run_foreground

    sock = listen("127.0.0.1", 0)
    loaded = load_for_serving(str(args.model), arena_bytes=args.arena_bytes, pack_path=args.pack)
    if args.route_trace is not None:
        from strata_stream.trace.routing import route_by_trace

        route_by_trace(loaded.model, args.route_trace)
    config = ServeConfig(model_id="bench", max_queue=args.max_queue, max_batch=args.child_batch)
    app = create_app(loaded.model, loaded.tokenizer, config, stats=loaded.stats)
    run_foreground(app, "127.0.0.1", 0, log_level="warning", sock=sock)


@dataclass(frozen=True)
class ServedModel:
    path: Path
    pack: Path | None = None
    arena_bytes: int | None = None
    route_trace: Path | None = None


@contextlib.contextmanager
def start_server(
    model: ServedModel, max_queue: int, max_batch: int, timeout_s: float = 180
) -> Iterator[tuple[str, int]]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--serve-child", "--model",
           str(model.path), "--max-queue", str(max_queue),
           "--child-batch", str(max_batch)]  # fmt: skip
    if model.pack is not None:
        cmd += ["--pack", str(model.pack)]
    if model.arena_bytes is not None:
        cmd += ["--arena-bytes", str(model.arena_bytes)]
    if model.route_trace is not None:
        cmd += ["--route-trace", str(model.route_trace)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout or []], daemon=True).start()
    try:
        deadline = time.monotonic() + timeout_s
        url = ""
        while not url:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not start (run the command by hand to see why)")
            with contextlib.suppress(queue.Empty):
                line = lines.get(timeout=0.5)
                if "listening on " in line:
                    url = line.split("listening on ", 1)[1].strip()
        wait_healthy(url, deadline)
        yield url, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


def wait_healthy(url: str, deadline: float) -> None:
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}/health never answered 200")
        time.sleep(0.2)


def engine_counters(url: str) -> dict[str, float]:
    """The counters of ENGINE_COUNTERS in the server's /metrics (those it exports)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ENGINE_COUNTERS:
            out[name] = float(value)
    return out


def model_id(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
        return str(json.loads(r.read())["data"][0]["id"])


Streamer = Callable[[str, str, str, int], Iterator[tuple[bool, int]]]


def openai_streamer() -> Streamer:
    """A client's streams through one real `openai` client (httpx, a pydantic model a chunk):
    per chunk, whether it carries text, and the completion tokens (0 until the usage chunk)."""
    import openai  # here, not at the top: the server subprocess runs this file too

    clients: dict[str, Any] = {}

    def stream(url: str, mid: str, prompt: str, max_tokens: int) -> Iterator[tuple[bool, int]]:
        if url not in clients:
            clients[url] = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=120,
                                         max_retries=0)  # fmt: skip
        yield from _openai_chunks(clients[url], mid, prompt, max_tokens)

    return stream


def _openai_chunks(c: Any, mid: str, prompt: str, max_tokens: int) -> Iterator[tuple[bool, int]]:
    stream = c.chat.completions.create(
        model=mid,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        text = bool(chunk.choices and chunk.choices[0].delta.content)
        yield text, chunk.usage.completion_tokens if chunk.usage is not None else 0


def raw_streamer() -> Streamer:
    return raw_stream


def raw_stream(url: str, mid: str, prompt: str, max_tokens: int) -> Iterator[tuple[bool, int]]:
    """The same over http.client with one json.loads a chunk: a load generator that takes
    less of the cores it shares with the server."""
    import http.client

    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=120)
    body = json.dumps({"model": mid, "messages": [{"role": "user", "content": prompt}],
                       "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}})  # fmt: skip
    try:
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read()[:200]!r}")
        for line in r:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            choices = chunk.get("choices") or []
            text = bool(choices and (choices[0].get("delta") or {}).get("content"))
            usage = chunk.get("usage")
            yield text, int(usage["completion_tokens"]) if usage else 0
    finally:
        conn.close()


def run_level(
    url: str, mid: str, level: Level, max_tokens: int, max_requests: int, client_kind: str
) -> None:
    lock = threading.Lock()
    deadline = time.monotonic() + level.seconds
    def client(i: int) -> None:
        stream_of = openai_streamer() if client_kind == "openai" else raw_streamer()
        for n in range(max_requests):
            if time.monotonic() >= deadline:
                return
            prompt = PROMPTS[(i + n) % len(PROMPTS)]
            ttft, gaps, tokens = None, [], 0
            t0 = last = time.perf_counter()
            try:
                for text, used in stream_of(url, mid, prompt, max_tokens):
                    now = time.perf_counter()
                    if text:
                        if ttft is None:
                            ttft = now - t0
                        else:
                            gaps.append(now - last)
                        last = now
                    if used:
                        tokens = used
                if ttft is None or tokens == 0:
                    raise RuntimeError("a stream without tokens or usage")
            except Exception as e:
                with lock:
                    level.errors += 1
                    if len(level.error_samples) < 5:
                        level.error_samples.append(f"{type(e).__name__}: {e}")
                continue
            with lock:
                level.requests += 1
                level.tokens += tokens
                level.ttft_s.append(ttft)
                level.gaps_s.extend(gaps)

    threads = [
        threading.Thread(target=client, args=(i,), daemon=True) for i in range(level.clients)
    ]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(level.seconds + 300)
    level.seconds = time.monotonic() - t0  # includes draining the last in-flight requests


def plot(levels: list[Level], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    batches = sorted({lv.max_batch for lv in levels})
    for key, ax, label in (("ttft_s", a, "time to first token"), ("gaps_s", b, "inter-token gap")):
        for mb in batches:
            ours = [lv for lv in levels if lv.max_batch == mb]
            name = f"max-batch {mb}, " if mb else ""
            for p, style in ((50, "o-"), (99, "s--")):
                xs = sorted({lv.clients for lv in ours})
                ys = [
                    1e3 * pct([x for lv in ours if lv.clients == c for x in getattr(lv, key)], p)
                    for c in xs
                ]
                ax.plot(xs, ys, style, label=f"{name}p{p}")
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("ms")
        ax.set_title(label)
        ax.set_xticks(sorted({lv.clients for lv in levels}))
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle("strata-stream serve: latency against concurrency")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def build_model(tmp: Path, routing: str, arena_fraction: float, dense: str) -> ServedModel:
    """The checkpoint to serve when no --model is given, its pack, arena and routing."""
    from strata_stream.convert import convert
    from strata_stream.mlx_lm.random_model import make_chat_checkpoint, make_checkpoint
    from strata_stream.pack.reader import ExpertPack

    if routing == "trace":
        if dense == "float32":
            import mlx.core as mx

            path = make_checkpoint("qwen3_moe", tmp / "trace", seed=2, dims=TRACE_DIMS, chat=True,
                                   quantize=False, dtype=mx.float32)  # fmt: skip
        else:
            path = make_checkpoint("qwen3_moe", tmp / "trace", seed=2, dims=TRACE_DIMS, chat=True)
    else:
        path = make_chat_checkpoint(tmp / "tiny")
    pack = convert(path, tmp / "experts.strpk", progress=False)
    with ExpertPack.open(pack) as p:
        stride, top_k = p.record_stride, p.geometry.top_k
        arena = max(int(p.geometry.n_records * arena_fraction) * stride, 2 * top_k * stride)
    return ServedModel(path, pack, arena, TRACE if routing == "trace" else None)


def targets(done: list[Level], batched: int, single: int, at: int = 8) -> list[str]:
    """Issue 19's targets at `at` clients: batched against one at a time (max-batch 1)."""

    def level(b: int, n: int) -> dict[str, float | int] | None:
        ours = [lv for lv in done if lv.max_batch == b and lv.clients == n]
        if not ours:
            return None
        merged = Level(n, 0, sum(lv.seconds for lv in ours), max_batch=b)
        for lv in ours:
            merged.requests += lv.requests
            merged.tokens += lv.tokens
            merged.ttft_s += lv.ttft_s
            merged.gaps_s += lv.gaps_s
        return merged.summary()

    b8, s8, b1, s1 = level(batched, at), level(single, at), level(batched, 1), level(single, 1)
    if b8 is None or s8 is None:
        return []
    lines = [
        f"throughput at {at} clients: x{b8['tokens_per_s'] / max(s8['tokens_per_s'], 1e-9):.2f}"
        " one at a time's (target >= 3)",
        f"TTFT p50 at {at} clients: x{b8['ttft_p50_ms'] / max(s8['ttft_p50_ms'], 1e-9):.2f}"
        " one at a time's (target <= 0.5)",
    ]
    for name, lone in (("the batched server's", b1), ("one at a time's", s1)):
        if lone is not None:
            lines.append(
                f"token gap p50 at {at} clients: "
                f"x{b8['token_p50_ms'] / max(lone['token_p50_ms'], 1e-9):.2f} a lone client's on "
                f"{name} (target <= 1.5)"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", type=Path, help="model directory (default: one built here)")
    src.add_argument("--url", help="a running server on loopback, e.g. http://127.0.0.1:8080")
    ap.add_argument("--routing", choices=("trace", "model"), default=None,
                    help="experts chosen by the Qwen3 trace, or by the model's gates "
                         "(default: trace for the model built here, model with --model)")
    ap.add_argument("--dense", choices=("float32", "q4"), default="float32",
                    help="the trace model's weights (default float32; see the docstring)")
    ap.add_argument("--arena-fraction", type=float, default=0.25,
                    help="the built model's arena, as a fraction of its experts (default 0.25)")
    ap.add_argument("--clients", default="4,8", help="comma-separated levels (default 4,8)")
    ap.add_argument("--seconds", type=float, default=60.0, help="per level (default 60)")
    ap.add_argument("--repeats", type=int, default=1, help="interleaved repeats (default 1)")
    ap.add_argument("--max-tokens", type=int, default=32, help="per request (default 32)")
    ap.add_argument("--max-requests", type=int, default=100_000, help="per client per level")
    ap.add_argument("--client", choices=("raw", "openai"), default="raw",
                    help="the clients: a raw http.client reader (default), which takes little "
                    "of the cores the server runs on, or the real openai client")  # fmt: skip
    ap.add_argument("--max-batch", default="8",
                    help="the server's --max-batch, comma-separated: one server each (default 8)")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--plot", type=Path, help="write a PNG of latency against concurrency")
    # The server subprocess (start_server), not for direct use.
    ap.add_argument("--serve-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--pack", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--arena-bytes", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--route-trace", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--max-queue", type=int, default=8, help=argparse.SUPPRESS)
    ap.add_argument("--child-batch", type=int, default=8, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    require_matplotlib(ap, args.plot)
    if args.serve_child:
        serve_child(args)
        return 0
    levels_n = [int(x) for x in args.clients.split(",")]
    if min(levels_n) < 1 or args.seconds <= 0 or args.repeats < 1:
        ap.error("--clients, --seconds and --repeats must be positive")
    if not 0 < args.arena_fraction <= 1:
        ap.error("--arena-fraction must be in (0, 1]")
    routing = args.routing or ("model" if args.model or args.url else "trace")
    if args.url and args.routing:
        ap.error("--routing is the started server's: not with --url")

    batches = [int(x) for x in args.max_batch.split(",")]
    if min(batches) < 1:
        ap.error("--max-batch must be positive")
    done: list[Level] = []
    rss0 = float("nan")
    with contextlib.ExitStack() as stack:
        served: ServedModel | None = None
        if args.model is not None:
            served = ServedModel(args.model, route_trace=TRACE if routing == "trace" else None)
        elif not args.url:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="serve_load_"))
            served = build_model(Path(tmp), routing, args.arena_fraction, args.dense)
            print(f"model: {served.path.name}, routing: {routing}, arena "
                  f"{(served.arena_bytes or 0) / 2**20:.1f} MiB", flush=True)  # fmt: skip
        for b in [0] if args.url else batches:
            with contextlib.ExitStack() as server:
                if args.url:
                    host = urllib.parse.urlsplit(args.url).hostname
                    if host not in LOOPBACK_HOSTS:
                        ap.error(f"--url must be on loopback, got host {host!r}")
                    url, pid = args.url.rstrip("/"), None
                else:
                    assert served is not None
                    url, pid = server.enter_context(
                        start_server(served, max_queue=max(levels_n), max_batch=b)
                    )
                mid = model_id(url)
                warm = Level(1, 0, 2.0)
                run_level(url, mid, warm, args.max_tokens, 5, args.client)  # compile and warm first
                rss0 = rss_mb(pid) if pid else float("nan")
                for r in range(args.repeats):
                    for n in levels_n:
                        lv = Level(n, r, args.seconds, max_batch=b)
                        lv.rss_start_mb = rss_mb(pid) if pid else float("nan")
                        before = engine_counters(url)
                        run_level(url, mid, lv, args.max_tokens, args.max_requests, args.client)
                        time.sleep(0.6)  # the worker refreshes the engine's figures each 0.5 s
                        after = engine_counters(url)
                        lv.engine = {k: after[k] - before.get(k, 0.0) for k in after}
                        lv.rss_end_mb = rss_mb(pid) if pid else float("nan")
                        done.append(lv)
                        s = lv.summary()
                        print(json.dumps(s), flush=True)
                        for e in lv.error_samples:
                            print(f"  error: {e}", flush=True)

    cols = [
        "max_batch",
        "clients",
        "repeat",
        "requests",
        "errors",
        "tokens_per_s",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "token_p50_ms",
        "token_p99_ms",
        "experts_looked_up_per_token",
        "experts_read_per_token",
        "rss_start_mb",
        "rss_end_mb",
    ]
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for lv in done:
        s = lv.summary()
        print("| " + " | ".join(str(s[c]) for c in cols) + " |")
    if len(batches) > 1 and not args.url:
        first = batches[0]
        for b in batches[1:]:
            for n in levels_n:
                pairs = [
                    (x.summary(), y.summary())
                    for x, y in zip(
                        [lv for lv in done if lv.max_batch == b and lv.clients == n],
                        [lv for lv in done if lv.max_batch == first and lv.clients == n],
                        strict=False,
                    )
                ]
                print(
                    f"{n} clients, max-batch {b} vs {first}: throughput "
                    + ", ".join(f"x{x['tokens_per_s'] / max(y['tokens_per_s'], 1e-9):.2f}"
                                for x, y in pairs)
                    + "; TTFT p50 "
                    + ", ".join(f"x{x['ttft_p50_ms'] / max(y['ttft_p50_ms'], 1e-9):.2f}"
                                for x, y in pairs)
                    + "; token gap p50 "
                    + ", ".join(f"x{x['token_p50_ms'] / max(y['token_p50_ms'], 1e-9):.2f}"
                                for x, y in pairs)
                )  # fmt: skip
        if 1 in batches and max(batches) > 1:
            for line in targets(done, max(batches), 1):
                print(line)
    print(f"server RSS after warm-up {rss0:.1f} MB, at the end {done[-1].rss_end_mb:.1f} MB")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "url_was_given": bool(args.url),
                    "routing": None if args.url else routing,
                    "max_tokens": args.max_tokens,
                    "rss_after_warmup_mb": rss0,
                    "levels": [lv.summary() for lv in done],
                },
                indent=2,
            )
            + "\n"
        )
    if args.plot:
        plot(done, args.plot)
    errors = sum(lv.errors for lv in done)
    return 1 if errors else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
