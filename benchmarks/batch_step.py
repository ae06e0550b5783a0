"""Where a decode step of the continuous batch goes, against the batch size (no HTTP).

Drives serve/batch.py's ContinuousBatch directly with closed-loop greedy clients (each asks
again as soon as its answer ends, --max-tokens tokens of a short chat prompt, as
benchmarks/serve_load.py's clients do) on the tiny streamed checkpoint (or --model), and
reports per batch size:

- the per-token gap p50 / p99 each sequence sees (the server's side of serve_load's figure),
  and its ratio to batch 1's;
- per decode step: MLX's own work before each MoE layer (attention, norms, the gate: evaluated
  on its own), the engine's calls (the routed experts of the union, the handshake, the glue),
  and the server's per-token work (sampling bookkeeping, detokenizer, stop strings);
- the steps that also prefilled a joining request, and what they cost;
- the same model unstreamed on plain mlx-lm's BatchGenerator (its step at B against B=1), and
  one of the model's quantized Linears alone at B rows (MLX's CPU kernel, whose cost grows
  with the rows).

    python benchmarks/batch_step.py [--model DIR] [--route-trace CSV] [--batches 1,2,4,8,16]
        [--seconds 4]

--route-trace makes the model choose its experts by a routing trace (strata_stream.trace.
routing; the model needs the trace's geometry: benchmarks/serve_load.py builds one).
"""

from __future__ import annotations

import argparse
import collections
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from common import PieceTimes
from serve_load import PROMPTS  # the load test's prompts, so both measure the same requests


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))] if s else float("nan")




def closed_loop(model: Any, tok: Any, clients: int, seconds: float, max_tokens: int,
                timers: PieceTimes) -> dict[str, float]:  # fmt: skip
    from strata_stream.serve.batch import ContinuousBatch
    from strata_stream.serve.generation import GenerationRequest, SamplingParams
    from strata_stream.serve.jobs import Event, Finished, Job, TextChunk
    from strata_stream.serve.metrics import ServerMetrics

    gaps: list[float] = []
    last: dict[int, float] = {}
    ready: collections.deque[int] = collections.deque(range(clients))
    serial = [0]

    def new_job(i: int) -> Job:
        serial[0] += 1
        key = serial[0]
        text = PROMPTS[(i + key) % len(PROMPTS)]
        prompt = tuple(tok.apply_chat_template([{"role": "user", "content": text}],
                                               add_generation_prompt=True))  # fmt: skip

        def deliver(e: Event) -> None:
            if isinstance(e, TextChunk):
                now = time.perf_counter()
                if key in last:
                    gaps.append(now - last[key])
                last[key] = now
            elif isinstance(e, Finished):
                ready.append(i)

        return Job(GenerationRequest(prompt, max_tokens, SamplingParams(temperature=0)), deliver)

    batch = ContinuousBatch(model, tok, max_batch=clients, prefill_chunk=512,
                            metrics=ServerMetrics(), tokenizer_lock=threading.Lock(),
                            finish=lambda job, done: job.emit(done))  # fmt: skip
    steps: collections.Counter[str] = collections.Counter()
    spent: collections.defaultdict[str, float] = collections.defaultdict(float)
    warm_until = time.perf_counter() + min(1.0, seconds / 4)
    end = warm_until + seconds
    while time.perf_counter() < end:
        measuring = time.perf_counter() >= warm_until
        if measuring and not timers.on:
            model.strata_engine.window.reset_stats()
            timers.total.clear()
            gaps.clear()
            timers.on = True
        while ready:
            batch.admit(new_job(ready.popleft()))
        gen = batch._gen
        prefilling = len(gen._prompt_batch) + len(gen._unprocessed_sequences)
        t0 = time.perf_counter()
        batch.step()
        dt = time.perf_counter() - t0
        if measuring:
            kind = "prefill" if prefilling else "decode"
            steps[kind] += 1
            spent[kind] += dt
    timers.on = False
    batch.cut("length")
    n = max(steps["decode"] + steps["prefill"], 1)
    out = {
        "gap_p50_ms": 1e3 * pct(gaps, 50),
        "gap_p99_ms": 1e3 * pct(gaps, 99),
        "decode_step_ms": 1e3 * spent["decode"] / max(steps["decode"], 1),
        "prefill_steps": steps["prefill"] / n,
        "prefill_step_ms": 1e3 * spent["prefill"] / max(steps["prefill"], 1),
    }
    for name, v in timers.total.items():
        out[f"{name}_ms"] = 1e3 * v / n
    st = model.strata_engine.window.stats()["total"]
    out["stall_ms"] = 1e3 * st["stall_seconds"] / n
    out["misses"] = st["misses"] / n
    out["handshake_ms"] = 1e3 * st["handshake_seconds"] / n
    return out


def plain_scaling(path: Path, batches: list[int]) -> dict[int, float]:
    """Plain mlx-lm (experts in MLX, unstreamed): its BatchGenerator's decode step at B."""
    import mlx_lm
    from mlx_lm.generate import BatchGenerator

    model, tok = mlx_lm.load(str(path))
    prompt = list(tok.encode("hello world how are you"))
    out: dict[int, float] = {}
    for b in batches:
        gen = BatchGenerator(model, completion_batch_size=b, prefill_batch_size=b)
        gen.insert([prompt] * b, max_tokens=[10**6] * b)
        for _ in range(20):
            gen.next()
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(50):
                gen.next()
            best = min(best, (time.perf_counter() - t0) / 50)
        out[b] = 1e3 * best
    return out


def linear_scaling(model: Any, batches: list[int]) -> tuple[str, dict[int, float]]:
    """One of the model's attention projections alone at B rows, µs per call (a chain of 50
    evaluated at once, so eval's own cost is spread out)."""
    import mlx.core as mx

    proj = model.model.layers[0].self_attn.q_proj
    name = type(proj).__name__ + (f" q{proj.bits}" if hasattr(proj, "bits") else "")
    hidden = model.args.hidden_size
    dtype = proj.scales.dtype if hasattr(proj, "scales") else proj.weight.dtype
    out: dict[int, float] = {}
    for b in batches:
        x0 = mx.random.normal((b, 1, hidden)).astype(dtype)

        def chain(x: Any) -> Any:
            for _ in range(50):
                x = proj(x)[..., :hidden] * 0.5
            return x

        mx.eval(chain(x0))
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            mx.eval(chain(x0))
            best = min(best, time.perf_counter() - t0)
        out[b] = 1e6 * best / 50
    return name, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, help="model directory (default: the tiny checkpoint)")
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--seconds", type=float, default=4.0, help="per batch size (default 4)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--route-trace", type=Path, help="experts chosen by this routing trace")
    ap.add_argument("--arena-bytes", type=int, help="the streamed model's arena")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved; the best is kept")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    import mlx.core as mx

    import strata_stream.mlx_lm.engine as engine
    import strata_stream.serve.batch as batch_mod
    from strata_stream.serve.loader import load_for_serving

    with tempfile.TemporaryDirectory(prefix="batch_step_") as tmp:
        path = args.model
        if path is None:
            from strata_stream.mlx_lm.random_model import make_chat_checkpoint

            path = make_chat_checkpoint(Path(tmp) / "tiny")
        loaded = load_for_serving(str(path), arena_bytes=args.arena_bytes)
        model, tok = loaded.model, loaded.tokenizer
        if args.route_trace is not None:
            from strata_stream.trace.routing import route_by_trace

            route_by_trace(model, args.route_trace)

        timers = PieceTimes()
        run_cpu = engine.MoeEngine.run_cpu

        def timed_run_cpu(self: Any, layer: int, x: Any, inds: Any) -> Any:
            # MLX's work up to this layer's routed experts, evaluated on its own, then ours.
            timers.wrap("mlx_dense", mx.eval)(x, inds)
            return timers.wrap("engine", run_cpu)(self, layer, x, inds)

        engine.MoeEngine.run_cpu = timed_run_cpu  # type: ignore[method-assign]
        batch_mod.ContinuousBatch._token = timers.wrap(  # type: ignore[method-assign]
            "server_per_token", batch_mod.ContinuousBatch._token
        )
        results: dict[int, dict[str, float]] = {}
        for _ in range(args.repeats):
            for b in batches:
                r = closed_loop(model, tok, b, args.seconds, args.max_tokens, timers)
                if b not in results or r["gap_p50_ms"] < results[b]["gap_p50_ms"]:
                    results[b] = r
        base = results[batches[0]]["gap_p50_ms"]
        cols = ["gap_p50_ms", "gap_p99_ms", "decode_step_ms", "mlx_dense_ms", "engine_ms",
                "server_per_token_ms", "stall_ms", "misses", "handshake_ms", "prefill_steps",
            "prefill_step_ms"]  # fmt: skip
        print("| B | " + " | ".join(cols) + " | gap p50 vs B=1 |")
        print("|---" * (len(cols) + 2) + "|")
        for b in batches:
            r = results[b]
            cells = " | ".join(f"{r.get(c, float('nan')):.3f}" for c in cols)
            print(f"| {b} | {cells} | x{r['gap_p50_ms'] / base:.2f} |")
        print("(per-step columns: ms per step, prefill and decode steps together; "
              "prefill_steps: their share)")  # fmt: skip
        name, lin = linear_scaling(model, batches)
        print(f"MLX {name} alone, µs per call at B rows: "
              + ", ".join(f"B={b} {v:.1f}" for b, v in lin.items()))  # fmt: skip
        if args.route_trace is not None:
            return  # plain mlx-lm would route by the model's own gates: not comparable
        plain = plain_scaling(path, batches)
        print("plain mlx-lm BatchGenerator (unstreamed), decode step ms: "
              + ", ".join(f"B={b} {v:.3f} (x{v / plain[batches[0]]:.2f})"
                          for b, v in plain.items()))  # fmt: skip


if __name__ == "__main__":
    main()
