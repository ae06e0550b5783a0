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
script (the hidden --one flag) so its peak RSS (getrusage ru_maxrss at the end) is its own; the
configurations are interleaved across --repeats so a noisy machine hits them alike. Prompt and
decode tokens/s come from mlx_lm.stream_generate after one short warm-up generation; hit rate
and GB read per token are the engine's over the decode tokens only.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_PLAIN, _STREAMED = "plain", "streamed"
# The CPU backend rounding once in float32 instead of reproducing mlx-lm's arithmetic (the
# default, arithmetic="auto"): all resident, to show what exactness costs.
_STREAMED_F32 = "streamed-float32"


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
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    prompt = _prompt(prompt_words)
    row: dict[str, Any] = {"mode": mode, "arena_fraction": fraction}
    if mode == _PLAIN:
        import mlx_lm

        model, tok = mlx_lm.load(str(model_dir))
        engine = None
    else:
        from strata_stream.config import StreamConfig
        from strata_stream.mlx_lm import load
        from strata_stream.pack import ExpertPack

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
        row["arithmetic"] = arithmetic
        row["arena_bytes"] = arena
        row["direct_io"] = bool(engine.config.direct_io)
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
        engine.close()
    row["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB
    return row


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
    plain_rss = [r["peak_rss_bytes"] for r in rows if r["mode"] == _PLAIN]
    lines = [
        "| configuration | decode tok/s | prompt tok/s | peak RSS GB | RSS vs plain "
        "| decode hit rate | GB read / token |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, frac in configs:
        rs = [r for r in rows if (r["mode"], r["arena_fraction"]) == (mode, frac)]
        rss = [r["peak_rss_bytes"] / 1e9 for r in rs]
        ratio = (f"x{_median([r['peak_rss_bytes'] for r in rs]) / _median(plain_rss):.2f}"
                 if plain_rss else "-")  # fmt: skip
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
              ("peak_rss_bytes", "peak RSS (GB)", 1e-9)]  # fmt: skip
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
    p.add_argument("--one", nargs=2, metavar=("MODE", "FRACTION"), help=argparse.SUPPRESS)
    args = p.parse_args()

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
            t0 = time.perf_counter()
            out = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
            found = [ln for ln in out.stdout.splitlines() if ln.startswith("ROW ")]
            if out.returncode != 0 or not found:
                sys.exit(f"{_label(mode, frac)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
            row = json.loads(found[-1][4:])
            row["repeat"] = rep
            rows.append(row)
            print(f"repeat {rep + 1}/{args.repeats} {_label(mode, frac):<24} "
                  f"decode {row['decode_tokens_per_s']:.2f} tok/s  prompt "
                  f"{row['prompt_tokens_per_s']:.2f} tok/s  peak RSS "
                  f"{row['peak_rss_bytes'] / 1e9:.2f} GB  ({time.perf_counter() - t0:.0f} s)",
                  flush=True)  # fmt: skip

    table, headline = summarize(rows)
    desc = (f"model {model_dir.name}, prompt {args.prompt_words} tokens, {args.tokens} decode "
            f"tokens, {args.repeats} repeats, {time.perf_counter() - t_start:.0f} s")  # fmt: skip
    print(f"\n{desc}: median [min, max]\n{table}")
    if args.json is not None:
        doc = {"model": str(model_dir), "prompt_tokens": args.prompt_words,
               "decode_tokens": args.tokens, "repeats": args.repeats, "rows": rows,
               "streamed_over_plain_decode": headline}  # fmt: skip
        args.json.write_text(json.dumps(doc, indent=2))
    if args.plot is not None:
        plot(rows, args.plot, f"mlx-lm end to end, Qwen3-30B-A3B expert shapes: {desc}")


if __name__ == "__main__":
    main()
