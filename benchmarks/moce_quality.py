"""moce quality against speed: what cache-aware routing costs in output and buys in tokens/s.

    python benchmarks/moce_quality.py [--pack P] [--json OUT] [--tokens N] [--arena F]

On the `demo` preset (16 layers x 64 experts, top-8, q4) with an arena of --arena (default 25%)
of the experts and next-layer prediction on, the same synthetic-driver sequence (a prompt, then
--tokens decode steps) runs once with exact routing (moce off) and once per moce setting. Each
row reports, against the exact run of the same inputs:

- cosine similarity of every token's MoE block output (mean and worst over tokens x layers);
- router probability mass moved off the true top-k and replaced choices, per token per layer
  (Window.stats(), as the engine measured them);
- decode tokens/s and its ratio to the exact run, hit rate and bytes read per token.

The synthetic driver's layer inputs do not depend on MoE outputs, so every setting sees the same
inputs and the cosine is each block's own error, not drift compounded through the model. The
exact run is repeated last: the two exact rows bound the timing noise of the machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from common import ensure_pack
from strata_stream import ExpertPack, ExpertStream, StreamConfig, Window
from strata_stream.synthetic import SyntheticDriver

SETTINGS: list[tuple[str, float | None]] = [
    ("off", None),
    ("scale", 1.5),
    ("scale", 2.0),
    ("scale", 4.0),
    ("scale", 8.0),
    ("prune", 0.02),
    ("prune", 0.05),
    ("prune", 0.1),
    ("prune", 0.2),
    ("off", None),
]


def sequence(pack: ExpertPack, prompt: int, tokens: int, seed: int) -> list[list[np.ndarray]]:
    """Per step (the prompt, then each decode token), per layer, the layer input."""
    g = pack.geometry
    driver = SyntheticDriver(g, pack.router_weights, seed=seed)
    steps = [driver.prompt(prompt)] + [driver.decode() for _ in range(tokens)]
    return [[t.layer_input(layer) for layer in range(g.n_layers)] for t in steps]


def moce_run(
    path: Path, config: StreamConfig, steps: list[list[np.ndarray]]
) -> tuple[list[np.ndarray], dict[str, Any]]:
    """Every layer output of every step, and the decode figures (the prompt step is untimed)."""
    outs: list[np.ndarray] = []
    with ExpertStream(path, config) as stream, Window(stream) as window:
        with window.turn():
            outs.extend(window.moe(layer, x) for layer, x in enumerate(steps[0]))
        window.reset_stats()
        t0 = time.perf_counter()
        with window.turn():
            for xs in steps[1:]:
                outs.extend(window.moe(layer, x) for layer, x in enumerate(xs))
        wall = time.perf_counter() - t0
        total = window.stats()["total"]
    n = len(steps) - 1
    routed = total["tokens"]  # token x layer routings in the decode steps
    return outs, {
        "tokens_per_s": n / wall,
        "hit_rate": total["hit_rate"],
        "bytes_read_per_token": total["bytes_read"] / n,
        "moved_mass_per_routing": total["moce_moved_mass"] / routed,
        "changed_per_routing": total["moce_changed"] / routed,
        "settle_s_per_token": total["settle_seconds"] / n,
    }


def cosines(got: list[np.ndarray], exact: list[np.ndarray]) -> np.ndarray:
    a = np.concatenate(got).astype(np.float64)
    b = np.concatenate(exact).astype(np.float64)
    num = (a * b).sum(axis=1)
    den = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    out: np.ndarray = num / np.maximum(den, 1e-30)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--pack", type=Path)
    ap.add_argument("--preset", default="demo")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--prompt", type=int, default=24)
    ap.add_argument("--arena", type=float, default=0.25, help="arena, fraction of all experts")
    ap.add_argument("--keep-top", type=int, default=2)
    ap.add_argument("--io-threads", type=int, default=StreamConfig.io_threads)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    path = ensure_pack(args.pack, args.preset)
    with ExpertPack.open(path) as pack:
        g = pack.geometry
        n_all = g.n_layers * g.n_experts
        n_slots = max(2 * g.top_k, int(n_all * args.arena))
        steps = sequence(pack, args.prompt, args.tokens, args.seed)
        base = StreamConfig.from_env(
            arena_bytes=n_slots * pack.record_stride,
            io_threads=args.io_threads,
            direct_io=True,
            persist_profile=False,
            moce_keep_top=args.keep_top,
        )
    print(
        f"{path.name}: {g.n_layers} layers x {g.n_experts} experts, top-{g.top_k}; arena "
        f"{n_slots}/{n_all} slots ({n_slots / n_all:.0%}); prompt {args.prompt}, decode "
        f"{args.tokens} tokens; keep_top {args.keep_top}; publish_prefetch "
        f"{int(base.publish_prefetch)}"
    )
    exact: list[np.ndarray] | None = None
    exact_tps = None
    rows = []
    header = (
        f"{'mode':<6} {'strength':>8} {'cos mean':>9} {'cos min':>8} {'moved/rt':>9} "
        f"{'chg/rt':>7} {'hit rate':>8} {'MB/tok':>7} {'tok/s':>7} {'vs off':>7}"
    )
    print(header)
    print("-" * len(header))
    for mode, strength in SETTINGS:
        config = base.replace(moce=mode, moce_strength=strength)
        outs, r = moce_run(path, config, steps)
        if exact is None:
            exact, exact_tps = outs, r["tokens_per_s"]
        assert exact_tps is not None
        # Decode rows only: the prompt step is a different regime (waves, no timing).
        n_prompt = g.n_layers
        cos = cosines(outs[n_prompt:], exact[n_prompt:])
        row = {
            "mode": mode,
            "strength": config.moce_strength_value if mode != "off" else None,
            "cos_mean": float(cos.mean()),
            "cos_min": float(cos.min()),
            "speedup": r["tokens_per_s"] / exact_tps,
            **r,
        }
        rows.append(row)
        s = "-" if row["strength"] is None else f"{row['strength']:g}"
        print(
            f"{mode:<6} {s:>8} {row['cos_mean']:9.5f} {row['cos_min']:8.4f} "
            f"{r['moved_mass_per_routing']:9.4f} {r['changed_per_routing']:7.3f} "
            f"{r['hit_rate']:8.3f} {r['bytes_read_per_token'] / 1e6:7.1f} "
            f"{r['tokens_per_s']:7.2f} {row['speedup']:7.2f}"
        )
    print(
        "moved/rt: true router probability mass moved off the true top-k per token-layer "
        "routing; chg/rt: replaced choices per routing (of top-k)"
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "pack": str(path),
                    "arena_slots": n_slots,
                    "n_experts_total": n_all,
                    "tokens": args.tokens,
                    "prompt": args.prompt,
                    "keep_top": args.keep_top,
                    "publish_prefetch": base.publish_prefetch,
                    "rows": rows,
                },
                indent=2,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
