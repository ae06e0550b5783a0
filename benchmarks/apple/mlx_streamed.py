"""The model streamed through strata-stream: prompt and decode tokens/s at several arenas.

    python benchmarks/apple/mlx_streamed.py [--model mlx-community/Qwen3-30B-A3B-4bit]
        [--fractions 0.1 0.25 0.5 1.0] [--experts mlx metal] [--json OUT]

For each expert path (MLX's gather_qmm over the arena, or the engine's Metal backend) and each
arena fraction (a share of all the model's experts), loads the model with
`strata_stream.mlx_lm.load` (the pack is converted into the cache on the first run), generates
with mlx-lm's own loop and records prompt and decode tokens/s (median, min and max of --repeats)
with the engine's hit rate and bytes read. The plain mlx-lm figure to compare with comes from
mlx_baseline.py, run by the same plan.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mlx-community/Qwen3-30B-A3B-4bit")
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.1, 0.25, 0.5, 1.0])
    ap.add_argument("--experts", nargs="+", default=["mlx", "metal"], choices=["mlx", "metal"])
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    import mlx_lm  # only on the Mac: the dry run never imports it

    from strata_stream.mlx_lm import load
    from strata_stream.pack import ExpertPack

    # The first load converts the experts into the cache (once); its pack sizes the arenas.
    model, _ = load(args.model, experts="cpu")
    pack = model.strata_engine.stream.path
    model.strata_engine.close()
    with ExpertPack.open(pack) as p:
        total = p.geometry.n_records * p.record_stride
    rows: list[dict[str, Any]] = []
    for experts in args.experts:
        for fraction in args.fractions:
            model, tokenizer = load(
                args.model, arena_bytes=max(int(total * fraction), 1), experts=experts,
                pack_path=pack,
            )  # fmt: skip
            prompt = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 64)
            prompt = prompt[: args.prompt_tokens]
            prompt_tps, decode_tps = [], []
            try:
                for _ in range(args.repeats):
                    last = None
                    for r in mlx_lm.stream_generate(model, tokenizer, prompt,
                                                    max_tokens=args.tokens):  # fmt: skip
                        last = r
                    assert last is not None
                    prompt_tps.append(float(last.prompt_tps))
                    decode_tps.append(float(last.generation_tps))
                total_stats = model.strata_engine.window.stats()["total"]
            finally:
                model.strata_engine.close()
            row = {
                "experts": experts,
                "arena_fraction": fraction,
                "prompt_tokens_per_s": _spread(prompt_tps),
                "decode_tokens_per_s": _spread(decode_tps),
                "hit_rate": total_stats["hit_rate"],
                "bytes_read": total_stats["bytes_read"],
            }
            rows.append(row)
            print(
                f"{experts} at {fraction:.0%}: prompt {row['prompt_tokens_per_s']['median']:.0f}"
                f" tok/s, decode {row['decode_tokens_per_s']['median']:.1f} tok/s, hit rate "
                f"{row['hit_rate']}"
            )
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "rows": rows}, indent=2))
    return 0


def _spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


if __name__ == "__main__":
    sys.exit(main())
