"""Plain mlx-lm on the same model: prompt and decode tokens/s, the figure to beat.

    python benchmarks/apple/mlx_baseline.py [--model mlx-community/Qwen3-30B-A3B-4bit] [--json OUT]

mlx-lm's own generation loop (`mlx_lm.stream_generate`) with every weight in memory; prompt
tokens/s and generation tokens/s as mlx-lm reports them, median of --repeats with min and max.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mlx-community/Qwen3-30B-A3B-4bit")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    import mlx_lm  # only on the Mac: the dry run never imports it

    model, tokenizer = mlx_lm.load(args.model)
    prompt = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 64)
    prompt = prompt[: args.prompt_tokens]
    prompt_tps, decode_tps = [], []
    for _ in range(args.repeats):
        last = None
        for response in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=args.tokens):
            last = response  # the final response carries the run's prompt and generation tok/s
        assert last is not None
        prompt_tps.append(float(last.prompt_tps))
        decode_tps.append(float(last.generation_tps))

    def spread(xs: list[float]) -> dict[str, float]:
        return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}

    out = {
        "model": args.model,
        "prompt_tokens_per_s": spread(prompt_tps),
        "decode_tokens_per_s": spread(decode_tps),
    }
    print(
        f"mlx-lm {args.model}: prompt {out['prompt_tokens_per_s']['median']:.0f} tok/s, "
        f"decode {out['decode_tokens_per_s']['median']:.1f} tok/s"
    )
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
