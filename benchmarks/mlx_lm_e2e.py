"""End to end: plain mlx-lm vs streamed experts on a model with Qwen3-30B-A3B's expert shapes.

    python benchmarks/mlx_lm_e2e.py --json e2e.json --plot docs/figures/mlx_lm_e2e.png
    python benchmarks/mlx_lm_e2e.py --model DIR --fractions 0.1 0.5 --repeats 3

The default model is random qwen3_moe weights with Qwen3-30B-A3B's routed experts (hidden 2048,
moe_intermediate 768, 128 experts, top-8, q4 g64 experts and 8-bit routers as `mlx_lm.convert
-q` writes them) over --layers layers (12: about 4 GB of experts), attention and vocabulary tiny.
It is built once into strata_stream.paths.cache_dir() and converted once into a pack there.

Configurations: plain mlx-lm; streamed (CPU expert backend, StreamConfig defaults from the
environment, arithmetic="auto": bitwise mlx-lm's numbers) with every expert resident; the same
with arithmetic="float32" (each output rounded once: faster, not bitwise); streamed with arenas
of each --fractions share of all experts. Each configuration runs in a fresh subprocess of this
script (the hidden --one flag); the configurations are interleaved across --repeats so a noisy
machine hits them alike. Prompt and decode tokens/s come from mlx_lm.stream_generate after one
short warm-up generation; hit rate and GB read per token are the engine's over the decode tokens
only.

Peak memory is the child's VmHWM (/proc/self/status at its end), which a fresh exec starts from
nothing; getrusage's ru_maxrss would carry over the peak of this parent (which may just have
built and converted the model). This parent samples the child's /proc/<pid>/status every 10 ms
for the anonymous / file-backed split at the peak, and the child says where the peak goes: the
interpreter and libraries (resident before loading), the arena (its resident pages), the
Window's scratch, the dense weights (MLX arrays, copied into anonymous memory, and any mapped
.safetensors pages), MLX's other allocations at their peak (activations, KV cache, its buffer
cache), and the rest. The memory table checks, for every configuration, peak <= arena + dense
weights + 256 MiB.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import require_matplotlib
from strata_stream.process_memory import (
    MemoryStatus,
    PeakSampler,
    mapped_file_bytes,
    memory_status,
    peak_bytes,
    resident_bytes,
)

_PLAIN, _STREAMED = "plain", "streamed"
# The CPU backend rounding once in float32 instead of reproducing mlx-lm's arithmetic (the
# default, arithmetic="auto"): all resident, to show what exactness costs.
_STREAMED_F32 = "streamed-float32"
# The issue-16 target: peak memory within arena + dense weights + this.
_BOUND_SLACK = 256 << 20


def default_model(layers: int) -> Path:
    """The cached random checkpoint with Qwen3-30B-A3B's expert shapes, built on first use."""
    from strata_stream.mlx_lm.random_model import make_large_checkpoint
    from strata_stream.paths import cache_dir

    path = cache_dir() / "models" / f"qwen3-30b-a3b-experts-random-{layers}L"
    done = path / ".complete"
    if not done.exists():
        print(f"building {path} (once)", flush=True)
        t0 = time.perf_counter()
        make_large_checkpoint(path, num_layers=layers)
        done.write_text("")
        print(f"built in {time.perf_counter() - t0:.0f} s", flush=True)
    return path


def pack_for(model_dir: Path) -> Path:
    """The model's pack in the cache directory, converted on first use."""
    from strata_stream.convert import convert
    from strata_stream.mlx_lm.loader import default_pack_path

    pack = default_pack_path(model_dir)
    if not pack.exists():
        print(f"converting into {pack} (once)", flush=True)
        pack.parent.mkdir(parents=True, exist_ok=True)
        partial = pack.with_suffix(".partial")
        convert(model_dir, partial, progress=False)
        partial.rename(pack)
    return pack


def _prompt(words: int) -> str:
    from strata_stream.mlx_lm.random_model import VOCAB

    return " ".join(VOCAB[i * 7 % len(VOCAB)] for i in range(words))


def measure_one(
    model_dir: Path,
    mode: str,
    fraction: float | None,
    prompt_words: int,
    tokens: int,
    temp: float = 1.0,
    seed: int = 0,
) -> dict[str, Any]:
    """One configuration in this process: a warm-up generation, then the measured one."""
    import mlx.core as mx
    import mlx_lm
    from mlx.utils import tree_flatten
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from strata_stream.config import StreamConfig
    from strata_stream.mlx_lm import load
    from strata_stream.pack import ExpertPack

    # Both configurations import the same modules before this reading: the interpreter and
    # libraries (mlx-lm imports transformers, which imports torch wherever it is installed).
    prompt = _prompt(prompt_words)
    before = memory_status()
    row: dict[str, Any] = {"mode": mode, "arena_fraction": fraction}
    if mode == _PLAIN:
        model, tok = mlx_lm.load(str(model_dir))
        engine = None
    else:
        assert fraction is not None
        pack = pack_for(model_dir)
        with ExpertPack.open(pack) as pk:
            total = pk.geometry.n_records * pk.record_stride
            minimum = 2 * pk.geometry.top_k * pk.record_stride
        arena = max(minimum, int(total * fraction))
        config = StreamConfig.from_env()
        arithmetic = "float32" if mode == _STREAMED_F32 else "auto"
        model, tok = load(str(model_dir), pack_path=pack, arena_bytes=arena, config=config,
                          experts="cpu", arithmetic=arithmetic, progress=False)  # fmt: skip
        engine = model.strata_engine
        largest_scratch = _track_scratch(engine.window)
        row["arithmetic"] = arithmetic
        row["arena_bytes"] = engine.stream.n_slots * engine.stream.record_stride
        row["direct_io"] = engine.stream.direct_io  # what the stream does (the default decides)
    row["dense_bytes"] = sum(int(v.nbytes) for _, v in tree_flatten(model.parameters()))
    for _ in stream_generate(model, tok, _prompt(8), max_tokens=2):  # warm up
        pass
    # Sampled, not greedy: a random model decoding greedily soon repeats one token, so its
    # routing would stay on the same experts and any arena would hit. The seed makes every
    # configuration draw the same tokens (the CPU path's logits agree with mlx-lm's closely).
    mx.random.seed(seed)
    sampler = make_sampler(temp=temp)
    if engine is not None:
        engine.window.reset_stats()
    first: dict[str, Any] | None = None
    last: Any = None
    for i, r in enumerate(stream_generate(model, tok, prompt, max_tokens=tokens, sampler=sampler)):
        if i == 0 and engine is not None:  # after the prompt: decode counters start here
            first = dict(engine.window.stats()["total"])
        last = r
    assert last is not None
    row["prompt_tokens_per_s"] = float(last.prompt_tps)
    row["decode_tokens_per_s"] = float(last.generation_tps)
    row["decode_tokens"] = int(last.generation_tokens)
    row["prompt_tokens"] = int(last.prompt_tokens)
    if engine is not None and first is not None:
        end = engine.window.stats()["total"]
        hits = int(end["hits"]) - int(first["hits"])
        misses = int(end["misses"]) - int(first["misses"])
        decoded = max(1, int(last.generation_tokens) - 1)
        row["hit_rate"] = hits / (hits + misses) if hits + misses else None
        row["gb_read_per_token"] = (
            (int(end["bytes_read"]) - int(first["bytes_read"])) / decoded / 1e9
        )
    row.update(_where_memory_went(engine, before))
    if engine is not None:
        row["scratch_bytes"] = largest_scratch()
        engine.close()
    return row


def _track_scratch(window: Any) -> Callable[[], int]:
    """The largest scratch the Window held: it frees a prompt's at the end of the turn, so the
    figure at the end of a run is a decode step's. Read after every prompt chunk."""
    largest = [0]
    inner = window.moe_routed

    def moe_routed(layer: int, x: Any, ids: Any, *args: Any, **kwargs: Any) -> Any:
        out = inner(layer, x, ids, *args, **kwargs)
        if len(ids) > 1:
            largest[0] = max(largest[0], int(window.stats()["scratch_bytes"]))
        return out

    window.moe_routed = moe_routed
    return lambda: max(largest[0], int(window.stats()["scratch_bytes"]))


def _where_memory_went(engine: Any, before: MemoryStatus | None) -> dict[str, Any]:
    """This process's peak and its parts, read at the end of the run (the arena and mapped
    files only grow while the engine is open; MLX reports its own peak)."""
    import mlx.core as mx

    if before is None:  # no /proc (not Linux): the peak as getrusage says, no breakdown
        return {"peak_bytes": peak_bytes()}
    out: dict[str, Any] = {
        "peak_bytes": peak_bytes(),
        "libraries_bytes": before.resident,
        "mlx_peak_bytes": int(mx.get_peak_memory()),
        "dense_file_bytes": mapped_file_bytes((".safetensors",)),
        "pack_file_bytes": mapped_file_bytes((".strpk",)),
        "torch_imported": "torch" in sys.modules and sys.modules["torch"] is not None,
        "arena_resident_bytes": 0,
        "scratch_bytes": 0,
    }
    if engine is not None:
        view = engine.stream.arena_view()
        out["arena_resident_bytes"] = resident_bytes(view.ctypes.data, view.nbytes)
    return out


def _median(values: list[float]) -> float:
    return float(statistics.median(values))


def _spread(values: list[float], fmt: str = ".3g") -> str:
    if not values:
        return "-"
    return f"{_median(values):{fmt}} [{min(values):{fmt}}, {max(values):{fmt}}]"


def _label(mode: str, fraction: float | None) -> str:
    if mode == _PLAIN:
        return "plain mlx-lm"
    if mode == _STREAMED_F32:
        return "streamed, all resident, float32"
    return "streamed, all resident" if fraction == 1.0 else f"streamed, arena {fraction:.0%}"


def summarize(rows: list[dict[str, Any]]) -> tuple[str, float | None]:
    """The markdown table (median [min, max] over repeats) and the headline decode ratio."""
    configs: list[tuple[str, float | None]] = []
    for r in rows:
        key = (r["mode"], r["arena_fraction"])
        if key not in configs:
            configs.append(key)
    plain_rss = [r["peak_bytes"] for r in rows if r["mode"] == _PLAIN and "peak_bytes" in r]
    lines = [
        "| configuration | decode tok/s | prompt tok/s | peak memory GB | vs plain "
        "| decode hit rate | GB read / token |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, frac in configs:
        rs = [r for r in rows if (r["mode"], r["arena_fraction"]) == (mode, frac)]
        rss = [r["peak_bytes"] / 1e9 for r in rs if "peak_bytes" in r]
        ratio = (f"x{_median([r['peak_bytes'] for r in rs]) / _median(plain_rss):.2f}"
                 if plain_rss and rss else "-")  # fmt: skip
        hit = [r["hit_rate"] for r in rs if r.get("hit_rate") is not None]
        gb = [r["gb_read_per_token"] for r in rs if r.get("gb_read_per_token") is not None]
        lines.append(
            f"| {_label(mode, frac)} | {_spread([r['decode_tokens_per_s'] for r in rs])} "
            f"| {_spread([r['prompt_tokens_per_s'] for r in rs])} | {_spread(rss)} | {ratio} "
            f"| {_spread(hit, '.3f') if hit else '-'} | {_spread(gb, '.3f') if gb else '-'} |"
        )
    ratios = []
    for rep in sorted({r["repeat"] for r in rows}):
        p = [r for r in rows if r["repeat"] == rep and r["mode"] == _PLAIN]
        s = [r for r in rows if r["repeat"] == rep and r["mode"] == _STREAMED
             and r["arena_fraction"] == 1.0]  # fmt: skip
        if p and s:
            ratios.append(s[0]["decode_tokens_per_s"] / p[0]["decode_tokens_per_s"])
    headline = _median(ratios) if ratios else None
    if ratios:
        lines.append("")
        lines.append(f"streamed all-resident / plain decode: x{_spread(ratios)} (median [min, max] "
                     f"over {len(ratios)} repeats; target >= 0.95)")  # fmt: skip
    f32 = []
    for rep in sorted({r["repeat"] for r in rows}):
        s = [r for r in rows if r["repeat"] == rep and r["mode"] == _STREAMED
             and r["arena_fraction"] == 1.0]  # fmt: skip
        f = [r for r in rows if r["repeat"] == rep and r["mode"] == _STREAMED_F32]
        if s and f:
            f32.append(f[0]["decode_tokens_per_s"] / s[0]["decode_tokens_per_s"])
    if f32:
        lines.append(f"float32 / mlx arithmetic, all resident, decode: x{_spread(f32)}")
    return "\n".join(lines), headline


def memory_parts(r: dict[str, Any]) -> dict[str, int]:
    """Where one run's peak went (bytes): the parts _where_memory_went read, and the rest."""
    parts = {
        "libraries": r["libraries_bytes"],
        "arena": r["arena_resident_bytes"],
        "scratch": r["scratch_bytes"],
        "dense": r["dense_bytes"],
        "dense_file": r["dense_file_bytes"],
        "mlx_other": max(0, r["mlx_peak_bytes"] - r["dense_bytes"]),
    }
    parts["rest"] = r["peak_bytes"] - sum(parts.values())
    return parts


def memory_table(rows: list[dict[str, Any]]) -> str:
    """Where peak memory goes, per configuration (median over repeats, GB), and the check
    peak <= arena + dense weights + 256 MiB side by side."""
    configs: list[tuple[str, float | None]] = []
    for r in rows:
        key = (r["mode"], r["arena_fraction"])
        if "libraries_bytes" in r and key not in configs:
            configs.append(key)
    if not configs:
        return "(no /proc here: no breakdown)"
    lines = [
        "| configuration | peak (VmHWM) | anon / file at peak | interpreter + libraries "
        "| arena | scratch | dense weights (copied / mapped) | MLX other | rest "
        "| bound: arena + dense + 256 MiB | within |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, frac in configs:
        rs = [r for r in rows if (r["mode"], r["arena_fraction"]) == (mode, frac)]
        med = {k: _median([float(memory_parts(r)[k]) for r in rs]) / 1e9
               for k in memory_parts(rs[0])}  # fmt: skip
        peak = _median([float(r["peak_bytes"]) for r in rs]) / 1e9
        anon = [r["peak_anonymous_bytes"] / 1e9 for r in rs if "peak_anonymous_bytes" in r]
        file = [r["peak_file_bytes"] / 1e9 for r in rs if "peak_file_bytes" in r]
        split = f"{_median(anon):.3f} / {_median(file):.3f}" if anon and file else "-"
        bounds = [r.get("arena_bytes", 0) + r["dense_bytes"] + _BOUND_SLACK for r in rs]
        bound = _median([float(b) for b in bounds]) / 1e9
        over = [r["peak_bytes"] - b for r, b in zip(rs, bounds, strict=True)]
        within = ("yes" if max(over) <= 0 else "no") + f" ({-max(over) / 2**20:+.0f} MiB)"
        lines.append(
            f"| {_label(mode, frac)} | {peak:.3f} | {split} | {med['libraries']:.3f} "
            f"| {med['arena']:.3f} | {med['scratch']:.4f} "
            f"| {med['dense']:.3f} / {med['dense_file']:.3f} | {med['mlx_other']:.3f} "
            f"| {med['rest']:.3f} | {bound:.3f} | {within} |"
        )
    torch = sum(1 for r in rows if r.get("torch_imported"))
    if torch:
        lines.append(f"\ntorch was imported (transformers imports it when installed) in {torch} of "
                     f"{len(rows)} runs: its libraries count in 'interpreter + libraries' "
                     "(--without-torch hides it)")  # fmt: skip
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    streamed = [r for r in rows if r["mode"] == _STREAMED]
    plain = [r for r in rows if r["mode"] == _PLAIN]
    fracs = sorted({float(r["arena_fraction"]) for r in streamed})
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    panels = [("decode_tokens_per_s", "decode tok/s", 1.0),
              ("prompt_tokens_per_s", "prompt tok/s", 1.0),
              ("peak_bytes", "peak memory, VmHWM (GB)", 1e-9)]  # fmt: skip
    for ax, (key, name, k) in zip(axes, panels, strict=True):
        med = [_median([r[key] * k for r in streamed if r["arena_fraction"] == f]) for f in fracs]
        for r in streamed:
            ax.plot(float(r["arena_fraction"]) * 100, r[key] * k, ".", color="C0", alpha=0.4)
        ax.plot([f * 100 for f in fracs], med, "o-", color="C0", label="streamed (CPU experts)")
        if plain:
            ax.axhline(_median([r[key] * k for r in plain]), color="C3", ls="--",
                       label="plain mlx-lm")  # fmt: skip
        ax.set_xlabel("arena (% of all experts)")
        ax.set_ylabel(name)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    bound = [_median([(r["arena_bytes"] + r["dense_bytes"] + _BOUND_SLACK) / 1e9
                      for r in streamed if r["arena_fraction"] == f]) for f in fracs]  # fmt: skip
    axes[2].plot([f * 100 for f in fracs], bound, ":", color="0.4",
                 label="arena + dense weights + 256 MiB")  # fmt: skip
    axes[2].legend(loc="upper left")
    axes[0].legend(loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, help="an mlx-lm MoE model directory (default: random)")
    p.add_argument("--layers", type=int, default=12, help="layers of the default model")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--tokens", type=int, default=16, help="decode tokens")
    p.add_argument("--prompt-words", type=int, default=32, help="prompt tokens (one per word)")
    p.add_argument("--fractions", type=float, nargs="+", default=[0.1, 0.25, 0.5],
                   help="arena sizes below all-resident, as shares of all experts")  # fmt: skip
    p.add_argument("--temp", type=float, default=1.0, help="sampling temperature (0: greedy)")
    p.add_argument("--json", type=Path, help="write the rows and the headline ratio here")
    p.add_argument("--plot", type=Path, help="write tok/s and peak RSS vs arena share here")
    p.add_argument("--without-torch", action="store_true",
                   help="hide an installed torch from transformers in every configuration "
                   "(mlx-lm imports transformers, which imports torch when it can)")  # fmt: skip
    p.add_argument("--one", nargs=2, metavar=("MODE", "FRACTION"), help=argparse.SUPPRESS)
    args = p.parse_args()
    require_matplotlib(p, args.plot)
    if args.without_torch:
        # importlib.util.find_spec("torch") is None from here on, as without torch installed.
        sys.modules["torch"] = None  # type: ignore[assignment]

    model_dir = args.model if args.model is not None else default_model(args.layers)
    if args.one is not None:
        mode, frac = args.one
        fraction = None if mode == _PLAIN else float(frac)
        row = measure_one(model_dir, mode, fraction, args.prompt_words, args.tokens, args.temp)
        print("ROW " + json.dumps(row), flush=True)
        return

    pack_for(model_dir)  # convert once, before any timed subprocess
    configs: list[tuple[str, float | None]] = [
        (_PLAIN, None),
        (_STREAMED, 1.0),
        (_STREAMED_F32, 1.0),
    ]
    configs += [(_STREAMED, f) for f in sorted(args.fractions, reverse=True) if f < 1.0]
    rows: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    for rep in range(args.repeats):
        # Rotate the order each repeat so no configuration always runs first (or last).
        order = configs[rep % len(configs) :] + configs[: rep % len(configs)]
        for mode, frac in order:
            cmd = [sys.executable, __file__, "--model", str(model_dir),
                   "--tokens", str(args.tokens), "--prompt-words", str(args.prompt_words),
                   "--temp", str(args.temp), "--one", mode, str(frac)]  # fmt: skip
            if args.without_torch:
                cmd.append("--without-torch")
            t0 = time.perf_counter()
            child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=os.environ.copy())  # fmt: skip
            with PeakSampler(child.pid, interval=0.01) as sampler:
                stdout, stderr = child.communicate()
            found = [ln for ln in stdout.splitlines() if ln.startswith("ROW ")]
            if child.returncode != 0 or not found:
                sys.exit(f"{_label(mode, frac)} failed ({child.returncode}):\n{stderr[-3000:]}")
            row = json.loads(found[-1][4:])
            row["repeat"] = rep
            if sampler.at_peak is not None:
                row["peak_anonymous_bytes"] = sampler.at_peak.anonymous
                row["peak_file_bytes"] = sampler.at_peak.file_backed
            rows.append(row)
            peak = f"{row['peak_bytes'] / 1e9:.2f} GB" if "peak_bytes" in row else "-"
            print(f"repeat {rep + 1}/{args.repeats} {_label(mode, frac):<24} "
                  f"decode {row['decode_tokens_per_s']:.2f} tok/s  prompt "
                  f"{row['prompt_tokens_per_s']:.2f} tok/s  peak memory {peak}  "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip

    table, headline = summarize(rows)
    desc = (f"model {model_dir.name}, prompt {args.prompt_words} tokens, {args.tokens} decode "
            f"tokens, {args.repeats} repeats, {time.perf_counter() - t_start:.0f} s")  # fmt: skip
    print(f"\n{desc}: median [min, max]\n{table}")
    print(f"\nwhere peak memory goes (GB, median over repeats):\n{memory_table(rows)}")
    if args.json is not None:
        doc = {"model": str(model_dir), "prompt_tokens": args.prompt_words,
               "decode_tokens": args.tokens, "repeats": args.repeats, "rows": rows,
               "streamed_over_plain_decode": headline}  # fmt: skip
        args.json.write_text(json.dumps(doc, indent=2))
    if args.plot is not None:
        plot(rows, args.plot, f"mlx-lm end to end, Qwen3-30B-A3B expert shapes: {desc}")


if __name__ == "__main__":
    main()
