"""One backend on the qwen3-30b-a3b preset pack: kernel GB/s, handshake us/layer, tokens/s.

    python benchmarks/apple/window_bench.py [--backend metal] [--pack P] [--json OUT]

- kernel GB/s: decode steps with every expert resident (the pass is replayed once untimed), the
  expert bytes the routed experts occupy per layer call over its wall time;
- handshake: Window.stats() host seconds per layer call at each arena;
- decode tokens/s (synthetic driver: one token through every layer) and prompt tokens/s (a chunk
  of --prompt tokens) at arenas of --fractions of all experts, next-layer prediction on.
Every figure is the median of --repeats, reported with its min and max.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import ensure_pack  # noqa: E402
from strata_stream import ExpertPack, ExpertStream, StreamConfig, Window  # noqa: E402
from strata_stream.synthetic import SyntheticDriver  # noqa: E402


def spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def measure(
    path: Path,
    pack: ExpertPack,
    backend: str,
    fraction: float,
    prompt: int,
    tokens: int,
    seed: int,
    warm: bool,
) -> dict[str, float]:
    g = pack.geometry
    slots = max(2 * g.top_k * 8, int(pack.n_records * fraction))
    config = StreamConfig.from_env(arena_bytes=slots * pack.record_stride, direct_io=True)
    with ExpertStream(path, config) as stream, Window(stream, backend=backend) as window:
        for attempt in range(2 if warm else 1):
            driver = SyntheticDriver(g, pack.router_weights, seed=seed)
            x = driver.prompt(prompt)
            window.reset_stats()
            t0 = time.perf_counter()
            with window.turn():
                for layer in range(g.n_layers):
                    window.moe(layer, x.layer_input(layer))
            prompt_s = time.perf_counter() - t0
            steps = [driver.decode() for _ in range(tokens)]
            inputs = [[t.layer_input(layer) for layer in range(g.n_layers)] for t in steps]
            window.reset_stats()
            t0 = time.perf_counter()
            with window.turn():
                for xs in inputs:
                    for layer in range(g.n_layers):
                        window.moe(layer, xs[layer])
            decode_s = time.perf_counter() - t0
            if warm and attempt == 0:
                continue
            total = window.stats()["total"]
            calls = max(1, total["calls"])
            return {
                "prompt_tokens_per_s": prompt / prompt_s,
                "decode_tokens_per_s": tokens / decode_s,
                "handshake_us_per_layer": 1e6 * total["handshake_seconds"] / calls,
                "decode_s_per_layer": decode_s / (tokens * g.n_layers),
                "hit_rate": total["hit_rate"] or 0.0,
            }
    raise AssertionError("unreachable")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="metal")
    ap.add_argument("--pack", type=Path)
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.10, 0.25, 0.50, 1.00])
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    path = ensure_pack(args.pack)
    out: dict[str, Any] = {"backend": args.backend, "pack": str(path), "arenas": []}
    with ExpertPack.open(path) as pack:
        g = pack.geometry
        # Kernel GB/s: all resident and warm, so a layer call is the device work plus the
        # handshake; bytes = the k routed experts' records (what decode must read per call).
        runs = [
            measure(
                path, pack, args.backend, 1.0, args.prompt, args.tokens, args.seed + r, warm=True
            )
            for r in range(args.repeats)
        ]
        gbps = [g.top_k * pack.record_bytes / r["decode_s_per_layer"] / 1e9 for r in runs]
        out["kernel_gb_per_s"] = spread(gbps)
        print(f"{args.backend}: decode layer call, all resident: {spread(gbps)['median']:.1f} GB/s")
        for fraction in args.fractions:
            rs = [
                measure(
                    path,
                    pack,
                    args.backend,
                    fraction,
                    args.prompt,
                    args.tokens,
                    args.seed + r,
                    warm=False,
                )
                for r in range(args.repeats)
            ]
            row = {"fraction": fraction}
            row.update({k: spread([r[k] for r in rs]) for k in rs[0]})
            out["arenas"].append(row)
            print(
                f"{args.backend} arena {fraction:.0%}: decode "
                f"{row['decode_tokens_per_s']['median']:.2f} tok/s, prompt "
                f"{row['prompt_tokens_per_s']['median']:.1f} tok/s, handshake "
                f"{row['handshake_us_per_layer']['median']:.0f} us/layer"
            )
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
