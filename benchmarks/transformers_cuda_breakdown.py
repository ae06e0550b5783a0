"""Where a decode token's time goes on CUDA: streamed (every expert resident) against plain
transformers with grouped_mm experts, piece by piece, on benchmarks/transformers_cuda.py's model.
And where a prompt's goes: the same host spans over --prefills forwards of the --prompt-tokens
prompt (a long one, e.g. 2048, is where streamed fell furthest behind: docs/cuda.md).

    python benchmarks/transformers_cuda_breakdown.py [--layers 2] [--tokens 24]
        [--prompt-tokens 32] [--prefills 3] [--out DIR]

For each configuration, after a warm-up at the measured lengths (a shape's first call is not the
model's), a decode loop of --tokens steps (model forward with a DynamicCache, the next token the
argmax, kept on the GPU: no synchronization but the model's own):
- wall: ms a token, torch synchronized at the ends only;
- host spans: perf_counter around each piece, per token and per sparse layer (the decoder
  layer, attention, the sparse block, the model's router, the experts call and, streamed, the
  engine's pieces: predictions, the routing's copy to the host, the Window call and the
  binding inside it). Nested spans include their children. A second pass synchronizes torch's
  stream before the routing's copy, so that copy's cost on an idle GPU and the wait for torch's
  queued kernels are told apart;
- torch.profiler (CPU and CUDA activities) over a few tokens: the GPU's busy time a token (the
  union of every kernel and copy, all streams: the cuda backend's own stream too) against the
  wall, the top host ops, and a Chrome trace (--out, gzipped);
- micro-benchmarks on an idle GPU: a small device-to-host copy (a synchronization), the
  engine's routing copy, the Window call alone on fixed inputs, a torch kernel launch.
Run with STRATA_CUDA_TRACE=1 for the backend's own trace (printed when the engine closes).

--interleave N: then every configuration's model is loaded at once and N rounds alternate
between them (plain, streamed, plain, ...), each round a decode loop and a prefill with the
host spans on: a host whose speed drifts during the run (the H200's did, by more than the gap
between configurations: docs/cuda.md) then moves every configuration alike, and the per-round
figures show the drift itself.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common import PieceTimes
from strata_stream import ExpertPack, StreamConfig
from strata_stream.convert.pack_cache import ensure_pack
from strata_stream.paths import cache_dir
from strata_stream.transformers import engine as engine_mod
from strata_stream.transformers import load
from strata_stream.transformers.random_model import make_checkpoint

DIMS = {
    "hidden_size": 2048,
    "moe_intermediate_size": 768,
    "intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
}  # fmt: skip  (transformers_cuda.py's)


DEVICE = torch.device("cuda", 0)  # --device cpu: a dry run of this script on the CPU backend


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


TINY = {
    "hidden_size": 64,
    "moe_intermediate_size": 32,
    "intermediate_size": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
}  # fmt: skip  (--device cpu's dry run)


def _model_dir(layers: int, dims: dict[str, int]) -> Path:
    tag = "" if dims is DIMS else "-tiny"
    path = cache_dir() / "bench" / f"hf-qwen3-30b-a3b-experts-{layers}l-bf16{tag}"
    if not (path / "config.json").exists():
        make_checkpoint("qwen3_moe", path, dtype="bfloat16",
                        dims={**dims, "num_hidden_layers": layers})  # fmt: skip
    return path


class Spans(PieceTimes):
    """PieceTimes with the breakdown's reset and per-token view."""

    def reset(self) -> None:
        self.total.clear()
        self.calls.clear()

    def per_token_us(self, tokens: int) -> dict[str, float]:
        return {k: 1e6 * v / tokens for k, v in self.total.items()}


def _sparse_blocks(model: Any) -> list[Any]:
    return [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]


def instrument(
    model: Any, spans: Spans, streamed: bool, sync_before_copy: bool
) -> Callable[[], None]:
    """Puts spans around the pieces; returns the undo."""
    undo: list[Callable[[], None]] = []

    def patch_forward(module: Any, name: str) -> None:
        orig = module.forward
        module.forward = spans.wrap(name, orig)
        undo.append(lambda: delattr(module, "forward"))

    patch_forward(model, "model forward (all)")
    patch_forward(model.lm_head, "lm_head")
    for layer in model.model.layers:
        patch_forward(layer, "decoder layer")
        patch_forward(layer.self_attn, "attention")
        if hasattr(layer.mlp, "experts"):
            patch_forward(layer.mlp, "sparse block")
            patch_forward(layer.mlp.gate, "router (model's)")
            patch_forward(layer.mlp.experts, "experts call")
    if streamed:
        engine = model.strata_engine
        for attr, name in (("predictions", "  predictions"),):
            orig = getattr(engine, attr)
            setattr(engine, attr, spans.wrap(name, orig))
            undo.append(lambda a=attr: delattr(engine, a))
        # The routing's crossing: pinned copies + one event wait (CUDA), then the widening.
        owner, attr = (
            (engine.routing, "host_tables") if engine.routing else (engine_mod, "_host_tables")
        )
        orig_copy = getattr(owner, attr)
        timed_copy = spans.wrap("  routing to host", orig_copy)
        if sync_before_copy:
            wait = spans.wrap("  (torch's queue drains)", _sync)

            def copy(*a: Any) -> Any:
                wait()
                return timed_copy(*a)

            setattr(owner, attr, copy)
        else:
            setattr(owner, attr, timed_copy)
        if owner is engine_mod:
            undo.append(lambda: setattr(engine_mod, "_host_tables", orig_copy))
        else:
            undo.append(lambda: delattr(engine.routing, "host_tables"))
            engine.routing.to_host = spans.wrap("    copies + event wait", engine.routing.to_host)
            undo.append(lambda: delattr(engine.routing, "to_host"))
        window = engine.window
        for attr, name in (("moe_routed_device", "  Window.moe_routed_device"),
                           ("_routed_call", "    binding call (handshake + kernels)"),
                           ("wants_predictions", "    wants_predictions")):  # fmt: skip
            orig = getattr(window, attr)
            setattr(window, attr, spans.wrap(name, orig))
            undo.append(lambda a=attr: delattr(window, a))

    def restore() -> None:
        for u in reversed(undo):
            u()

    return restore


def _cache(model: Any) -> Any:
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # a transformers whose DynamicCache takes no config
        return DynamicCache()


def decode_loop(
    model: Any, prompt: torch.Tensor, tokens: int, spans: Spans | None = None
) -> tuple[float, float]:
    """(prefill s, decode s) of a greedy decode loop kept on the GPU; spans on for the decode
    steps alone."""

    cache = _cache(model)
    _sync()
    t0 = time.perf_counter()
    out = model(input_ids=prompt, past_key_values=cache, use_cache=True)
    nxt = out.logits[:, -1:].argmax(-1)
    _sync()
    t1 = time.perf_counter()
    if spans is not None:
        spans.on = True
    for _ in range(tokens):
        out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
    _sync()
    if spans is not None:
        spans.on = False
    return t1 - t0, time.perf_counter() - t1


def decode_spans(model: Any, prompt: torch.Tensor, tokens: int, streamed: bool,
                 sync: bool) -> dict[str, Any]:  # fmt: skip
    """The host spans of a decode loop of `tokens` after `prompt` (instrument's, torch's queue
    drained before the routing's copy with sync), per token and per sparse layer."""
    spans = Spans()
    restore = instrument(model, spans, streamed, sync)
    try:
        _, dec_s = decode_loop(model, prompt, tokens, spans)
    finally:
        restore()
    layers = len(_sparse_blocks(model))
    per_tok = spans.per_token_us(tokens)
    return {
        "wall_us_per_token": 1e6 * dec_s / tokens,
        "per_token_us": per_tok,
        "per_sparse_layer_us": {k: v / layers for k, v in per_tok.items()},
        "calls_per_token": {k: c / tokens for k, c in spans.calls.items()},
    }


def prefill_spans(model: Any, prompt: torch.Tensor, streamed: bool, n: int) -> dict[str, Any]:
    """The host spans of n prefills of `prompt` (each on a fresh cache, torch synchronized at
    its ends), per prefill and per sparse layer."""
    spans = Spans()
    restore = instrument(model, spans, streamed, False)
    walls = []
    try:
        for _ in range(n):
            cache = _cache(model)
            _sync()
            spans.on = True
            t0 = time.perf_counter()
            model(input_ids=prompt, past_key_values=cache, use_cache=True)
            _sync()
            walls.append(time.perf_counter() - t0)
            spans.on = False
    finally:
        restore()
    layers = len(_sparse_blocks(model))
    per = spans.per_token_us(n)  # per prefill
    return {"tokens": int(prompt.shape[1]), "wall_us": [1e6 * w for w in walls],
            "per_prefill_us": per, "per_sparse_layer_us": {k: v / layers for k, v in per.items()},
            "calls_per_prefill": {k: c / n for k, c in spans.calls.items()}}  # fmt: skip


def gpu_busy_us(prof: Any) -> tuple[float, dict[str, float]]:
    """Union of the device intervals (kernels, copies, sets) over all streams, us; and per
    stream."""
    intervals: list[tuple[float, float]] = []
    per_stream: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for ev in prof.events():
        dt = getattr(ev, "device_type", None)
        if dt is None or "CUDA" not in str(dt):
            continue
        start = float(ev.time_range.start)
        end = float(ev.time_range.end)
        if end <= start:
            continue
        intervals.append((start, end))
        per_stream[str(getattr(ev, "device_resource_id", "?"))].append((start, end))

    def union(iv: list[tuple[float, float]]) -> float:
        total, cur_s, cur_e = 0.0, None, None
        for s, e in sorted(iv):
            if cur_e is None or s > cur_e:
                if cur_e is not None:
                    total += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        if cur_e is not None:
            total += cur_e - cur_s
        return total

    return union(intervals), {k: union(v) for k, v in per_stream.items()}


def profile(model: Any, prompt: torch.Tensor, tokens: int, trace: Path | None) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    cache = _cache(model)
    with torch.no_grad():
        out = model(input_ids=prompt, past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        _sync()
        with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(tokens):
                out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
                nxt = out.logits[:, -1:].argmax(-1)
            _sync()
            wall = time.perf_counter() - t0
    busy, streams = gpu_busy_us(prof)
    try:
        table_cpu = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22)
        table_gpu = prof.key_averages().table(sort_by="self_device_time_total", row_limit=14)
    except Exception as e:  # the busy time stands without them
        table_cpu = table_gpu = f"(tables failed: {e!r})"
    if trace is not None:
        raw = trace.with_suffix("")
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as f, gzip.open(trace, "wb") as g:
            shutil.copyfileobj(f, g)
        raw.unlink()
    return {"profiled_wall_us_per_token": 1e6 * wall / tokens,
            "gpu_busy_us_per_token": busy / tokens,
            "gpu_busy_us_per_token_by_stream": {k: v / tokens for k, v in streams.items()},
            "table_cpu": table_cpu, "table_gpu": table_gpu}  # fmt: skip


def _us(fn: Callable[[], Any], n: int) -> float:
    """Median host us of fn() over n calls."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


@torch.no_grad()
def micro(model: Any | None, streamed: bool) -> dict[str, float]:
    out: dict[str, float] = {}
    dev = DEVICE
    small = torch.zeros(1, 24, dtype=torch.int32, device=dev)
    _sync()
    out["d2h copy of 96 bytes (.cpu(), idle GPU)"] = _us(lambda: small.cpu(), 300)
    if dev.type == "cuda":
        pinned = torch.empty(1, 24, dtype=torch.int32).pin_memory()
        ev = torch.cuda.Event()

        def pinned_copy() -> None:
            pinned.copy_(small, non_blocking=True)
            ev.record()
            ev.synchronize()

        out["d2h into pinned, non_blocking + event sync"] = _us(pinned_copy, 300)
    a = torch.zeros(1, 64, device=dev)
    out["torch kernel launch (add_, host)"] = _us(lambda: a.add_(1.0), 1000)
    _sync()
    out["torch.cuda.synchronize (idle)"] = _us(_sync, 300)
    if model is None:
        return out
    block = _sparse_blocks(model)[0]
    hidden = int(model.config.hidden_size)
    x = torch.randn(1, hidden, device=dev, dtype=torch.bfloat16)
    with torch.no_grad():
        _, w, ids = type(block.gate).forward(block.gate, x)
    _sync()
    out["router forward (host)"] = _us(lambda: type(block.gate).forward(block.gate, x), 200)
    _sync()
    if not streamed:
        with torch.no_grad():
            out["plain experts call (host, no sync)"] = _us(lambda: block.experts(x, ids, w), 200)
            _sync()

            def synced() -> None:
                block.experts(x, ids, w)
                _sync()

            out["plain experts call + sync"] = _us(synced, 200)
        return out
    engine = model.strata_engine
    window = engine.window
    tables = [ids, w, ids, ids]

    def old_copy() -> Any:  # before: cast kernels, one cat, a pageable .cpu()
        parts = [ids.to(torch.int32), w.to(torch.float32).view(torch.int32)]
        parts += [ids.to(torch.int32), ids.to(torch.int32)]
        host = torch.cat(parts, dim=1).cpu().numpy()
        return [np.ascontiguousarray(host[:, i * 8 : (i + 1) * 8]) for i in range(4)]

    copy = engine.routing.host_tables if engine.routing else engine_mod._host_tables
    out["routing to host, 2 predictions (idle GPU)"] = _us(lambda: copy(tables), 300)
    out["routing to host, none (idle GPU)"] = _us(lambda: copy([ids, w, None, None]), 300)
    out["routing to host, 2 predictions, before (cat + .cpu())"] = _us(old_copy, 300)
    n_layers = len(engine.blocks)

    def engine_turn() -> None:
        for layer in range(n_layers):
            engine.run(layer, x, ids, w)

    with torch.no_grad():
        engine_turn()
        out["engine.run a layer (fixed inputs)"] = _us(engine_turn, 100) / n_layers
    if dev.type != "cuda":
        return out
    ids_h, w_h, p1, p2 = copy(tables)
    xf = x.float()
    y = torch.empty_like(xf)
    out["window.wants_predictions"] = _us(lambda: window.wants_predictions(0, 1), 1000)
    out["_device_rows (x, __cuda_array_interface__)"] = _us(
        lambda: __import__("strata_stream.window", fromlist=["_device_rows"])._device_rows(
            xf, "x", hidden), 1000)  # fmt: skip
    want = [window.wants_predictions(layer, 1) for layer in range(n_layers)]

    def one_turn(stream: int | None = None) -> None:
        for layer in range(n_layers):
            window.moe_routed_device(layer, xf, ids_h, w_h, y,
                                     p1 if want[layer][0] else None,
                                     p2 if want[layer][1] else None, stream=stream)  # fmt: skip

    window.restart_pass()
    one_turn()
    out["Window.moe_routed_device a layer (fixed inputs, idle torch)"] = (
        _us(one_turn, 100) / n_layers
    )
    # Returning with the kernels queued: each call then retires the one before (a drain).
    s = torch.cuda.current_stream().cuda_stream
    out["Window.moe_routed_device a layer, queued (fixed inputs, idle torch)"] = (
        _us(lambda: one_turn(s), 100) / n_layers
    )
    return out


def run_config(name: str, model: Any, prompt: torch.Tensor, args: argparse.Namespace,
               streamed: bool) -> dict[str, Any]:  # fmt: skip
    row: dict[str, Any] = {"config": name}
    warm = torch.roll(prompt, 1, dims=1)
    if DEVICE.type == "cuda":  # transformers_cuda.py's measurement (generate), as it makes it
        import transformers_cuda  # benchmarks/ is this script's folder

        if streamed:
            transformers_cuda._run(model, prompt, 0)  # first touches of the experts
            model.strata_engine.window.reset_stats()
        row["generate_prompt_tps"], row["generate_decode_tps"] = transformers_cuda._run(
            model, prompt, args.tokens
        )
        if streamed:
            row["generate_hit_rate"] = model.strata_engine.window.stats()["total"]["hit_rate"]
    with torch.no_grad():
        if streamed:  # a long prompt routes to (nearly) every expert: all resident from here
            gen = torch.Generator().manual_seed(1)
            touch = torch.randint(2, 60, (1, 256), generator=gen).to(DEVICE)
            decode_loop(model, touch, 0)
        decode_loop(model, warm, args.tokens)  # every length's first call
        decode_loop(model, warm, args.tokens)
        if streamed:
            model.strata_engine.window.reset_stats()
        pre, dec = decode_loop(model, prompt, args.tokens)
        row["loop_ms_per_token"] = 1e3 * dec / args.tokens
        row["loop_prefill_ms"] = 1e3 * pre
        if streamed:
            total = model.strata_engine.window.stats()["total"]
            row["hit_rate"] = total["hit_rate"]
            row["misses"] = total["misses"]
        for sync in (False, True) if streamed else (False,):
            key = "host_spans_synced" if sync else "host_spans"
            row[key] = decode_spans(model, prompt, args.tokens, streamed, sync)
        if args.prefills > 0:  # every piece's first call at this length is behind us
            row["prefill_spans"] = prefill_spans(model, prompt, streamed, args.prefills)
    trace = (
        Path(args.out) / f"trace_{'streamed' if streamed else 'plain'}.json.gz"
        if args.out
        else None
    )
    try:
        row["profile"] = profile(model, prompt, args.profile_tokens, trace)
    except Exception as e:  # the rest stands without it
        row["profile_error"] = repr(e)
    try:
        row["micro_us"] = micro(model, streamed)
    except Exception as e:
        row["micro_error"] = repr(e)
    return row


def load_config(cfg: str, path: Path, pack: Path, everything: int) -> tuple[str, Any]:
    """(name, model) of one configuration, in eval mode."""
    if cfg == "streamed":
        model = load(path, pack_path=pack, arena_bytes=int(everything),
                     dtype=torch.bfloat16, device=str(DEVICE), config=StreamConfig.from_env(),
                     progress=False)  # fmt: skip
        name = "streamed, all resident"
    else:
        from transformers import AutoModelForCausalLM

        where = {"device_map": {"": DEVICE}} if DEVICE.type == "cuda" else {}
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.bfloat16, experts_implementation=cfg, **where)  # fmt: skip
        name = f"plain transformers ({cfg})"
    model.eval()
    return name, model


# The spans the interleaved rounds report, per sparse layer.
_ROUND_SPANS = ("attention", "router (model's)", "experts call", "decoder layer")


def interleaved(models: list[tuple[str, Any, bool]], prompt: torch.Tensor,
                args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    """--interleave rounds over every model in turn: each round a decode loop of --tokens and
    one prefill of the prompt, host spans on; per configuration the per-round figures."""
    out: dict[str, Any] = {name: {"loop_ms_per_token": [], "prefill_ms": [],
                                  **{f"decode {k} us/layer": [] for k in _ROUND_SPANS},
                                  **{f"prefill {k} us/layer": [] for k in _ROUND_SPANS}}
                           for name, _, _ in models}  # fmt: skip
    with torch.no_grad():
        for _, model, _ in models:  # every length's first call, before any round
            decode_loop(model, torch.roll(prompt, 1, dims=1), args.tokens)
        for _ in range(args.interleave):
            for name, model, streamed in models:
                row = out[name]
                dec = decode_spans(model, prompt, args.tokens, streamed, False)
                row["loop_ms_per_token"].append(dec["wall_us_per_token"] / 1e3)
                for k in _ROUND_SPANS:
                    row[f"decode {k} us/layer"].append(dec["per_sparse_layer_us"].get(k, 0.0))
                pf = prefill_spans(model, prompt, streamed, 1)
                row["prefill_ms"].append(pf["wall_us"][0] / 1e3)
                for k in _ROUND_SPANS:
                    row[f"prefill {k} us/layer"].append(pf["per_sparse_layer_us"].get(k, 0.0))
    return out


def show_interleaved(rounds: dict[str, Any]) -> None:
    print("\n===== interleaved rounds: median [each round, in order]")
    for name, row in rounds.items():
        print(f"-- {name}")
        for k, v in row.items():
            each = ", ".join(f"{x:.1f}" if x >= 10 else f"{x:.2f}" for x in v)
            print(f"   {k:<40} {statistics.median(v):9.2f}  [{each}]")


def show(row: dict[str, Any]) -> None:
    print(
        f"\n===== {row['config']}: {row['loop_ms_per_token']:.3f} ms/token (decode loop), "
        f"prefill {row['loop_prefill_ms']:.1f} ms, hit rate {row.get('hit_rate', '-')}, "
        f"misses {row.get('misses', '-')}; generate (transformers_cuda.py's): decode "
        f"{row.get('generate_decode_tps', 0):.1f} tok/s, prompt "
        f"{row.get('generate_prompt_tps', 0):.0f} tok/s (hit rate {row.get('generate_hit_rate')})",
        flush=True,
    )
    for key in ("host_spans", "host_spans_synced"):
        if key not in row:
            continue
        s = row[key]
        print(
            f"-- {key}: wall {s['wall_us_per_token']:.0f} us/token; us per token | per "
            f"sparse layer | calls/token"
        )
        for k in s["per_token_us"]:
            print(
                f"   {k:<44} {s['per_token_us'][k]:9.1f} {s['per_sparse_layer_us'][k]:9.1f} "
                f"{s['calls_per_token'][k]:6.1f}"
            )
    pf = row.get("prefill_spans")
    if pf:
        walls = ", ".join(f"{w / 1e3:.1f}" for w in pf["wall_us"])
        print(f"-- prefill of {pf['tokens']} tokens: wall ms {walls}; us per prefill | per "
              f"sparse layer | calls/prefill")  # fmt: skip
        for k in pf["per_prefill_us"]:
            print(
                f"   {k:<44} {pf['per_prefill_us'][k]:9.1f} {pf['per_sparse_layer_us'][k]:9.1f} "
                f"{pf['calls_per_prefill'][k]:6.1f}"
            )
    p = row.get("profile")
    if p:
        print(
            f"-- profiler: wall {p['profiled_wall_us_per_token']:.0f} us/token, GPU busy "
            f"{p['gpu_busy_us_per_token']:.0f} us/token, by stream "
            f"{ {k: round(v) for k, v in p['gpu_busy_us_per_token_by_stream'].items()} }"
        )
        print(p["table_cpu"])
        print(p["table_gpu"])
    elif "profile_error" in row:
        print("-- profiler failed:", row["profile_error"])
    if "micro_us" in row:
        print("-- micro-benchmarks (median host us):")
        for k, v in row["micro_us"].items():
            print(f"   {k:<58} {v:9.1f}")
    elif "micro_error" in row:
        print("-- micro failed:", row["micro_error"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--profile-tokens", type=int, default=6)
    parser.add_argument("--prefills", type=int, default=3,
                        help="prefills timed piece by piece (0: none)")  # fmt: skip
    parser.add_argument("--configs", nargs="*", default=["grouped_mm", "streamed"],
                        choices=["eager", "grouped_mm", "streamed"])  # fmt: skip
    parser.add_argument("--out", default=None, help="folder for the JSON and the traces")
    parser.add_argument("--interleave", type=int, default=0, metavar="N",
                        help="N rounds alternating between the configurations' models, loaded "
                             "together, instead of one configuration after another")  # fmt: skip
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: dry run
    args = parser.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    path = _model_dir(args.layers, DIMS if DEVICE.type == "cuda" else TINY)
    pack = ensure_pack(path, None, progress=False)
    with ExpertPack.open(pack) as p:
        everything = p.geometry.n_records * p.record_stride
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(2, 60, (1, args.prompt_tokens), generator=gen).to(DEVICE)
    rows = []
    try:
        rows.append({"config": "idle GPU", "micro_us": micro(None, False)})
        print(json.dumps(rows[-1]), flush=True)
    except Exception as e:
        print("micro (no model) failed:", repr(e), flush=True)
    if args.interleave > 0:
        models = [(*load_config(cfg, path, pack, everything), cfg == "streamed")
                  for cfg in args.configs]  # fmt: skip
        try:
            rounds = interleaved(models, prompt, args)
        finally:
            for _, model, streamed in models:
                if streamed:
                    model.strata_engine.close()
        show_interleaved(rounds)
        if args.out:
            (Path(args.out) / "interleaved.json").write_text(json.dumps(rounds, indent=1) + "\n")
        return
    for cfg in args.configs:
        name, model = load_config(cfg, path, pack, everything)
        row = run_config(name, model, prompt, args, cfg == "streamed")
        if cfg == "streamed":
            row["window_stats_total"] = {k: v for k, v in model.strata_engine.window.stats()[
                "total"].items() if isinstance(v, (int, float))}  # fmt: skip
            model.strata_engine.close()  # STRATA_CUDA_TRACE=1 prints the backend's trace here
        rows.append(row)
        show(row)
        del model
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()
        if args.out:
            slim = [{k: v for k, v in r.items() if k != "profile"} | (
                {"profile": {k: v for k, v in r["profile"].items() if not k.startswith("table")}}
                if "profile" in r else {}) for r in rows]  # fmt: skip
            (Path(args.out) / "breakdown.json").write_text(json.dumps(slim, indent=1) + "\n")
    _ = np  # numpy is the engine's


if __name__ == "__main__":
    main()
