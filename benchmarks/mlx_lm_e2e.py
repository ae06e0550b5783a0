"""End to end: an mlx-lm model generating with plain mlx-lm vs with streamed experts.

    python benchmarks/mlx_lm_e2e.py                       # a random qwen3_moe, built once
    python benchmarks/mlx_lm_e2e.py --model DIR --shares 1 0.5 0.25

Every repeat runs every configuration once, in an interleaved order (plain mlx-lm first, then
each streamed one), so a noisy shared machine hits them alike; ratios to plain mlx-lm are
formed within a repeat and reported as median [min, max] over repeats. Streamed configurations:
the CPU backend at each arena share (a fraction of all experts) and, with --mlx, MLX's kernels
over the arena (on Linux it copies the arena each wave: a correctness path, not a fast one).
Prompt and decode tokens/s come from mlx_lm.stream_generate; hit rate, bytes read and stall
per decode token from the engine.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from strata_stream import StreamConfig
from strata_stream.convert import convert
from strata_stream.mlx_lm import load
from strata_stream.mlx_lm.random_model import VOCAB, make_checkpoint
from strata_stream.pack import ExpertPack


def run(model: Any, tokenizer: Any, prompt: str, tokens: int) -> dict[str, float]:
    from mlx_lm.generate import stream_generate

    last = None
    for r in stream_generate(model, tokenizer, prompt, max_tokens=tokens):
        last = r
    assert last is not None
    return {"prompt_tps": last.prompt_tps, "decode_tps": last.generation_tps,
            "decode_tokens": last.generation_tokens}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, help="an mlx-lm MoE model directory (default: random)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompt-words", type=int, default=64)
    p.add_argument("--shares", type=float, nargs="+", default=[1.0, 0.5, 0.25])
    p.add_argument("--mlx", action="store_true", help="also time experts='mlx' (all resident)")
    args = p.parse_args()

    import mlx_lm

    with tempfile.TemporaryDirectory(prefix="strata-e2e-") as tmp:
        model_dir = args.model
        if model_dir is None:
            dims = {"hidden_size": 512, "num_hidden_layers": 8, "num_experts": 64,
                    "moe_intermediate_size": 256, "intermediate_size": 512,
                    "num_experts_per_tok": 4}  # fmt: skip
            model_dir = make_checkpoint("qwen3_moe", Path(tmp) / "qwen3_moe", dims=dims)
        pack = convert(model_dir, Path(tmp) / "experts.strpk", progress=False)
        with ExpertPack.open(pack) as pk:
            total = pk.geometry.n_records * pk.record_stride
            minimum = 2 * pk.geometry.top_k * pk.record_stride
        prompt = " ".join(VOCAB[i * 7 % len(VOCAB)] for i in range(args.prompt_words))
        config = StreamConfig.from_env(direct_io=False, persist_profile=False)
        configs: list[tuple[str, str, float]] = [("cpu", f"cpu {s:.0%}", s) for s in args.shares]
        if args.mlx:
            configs.append(("mlx", "mlx 100%", 1.0))
        results: dict[str, list[dict[str, float]]] = {name: [] for _, name, _ in configs}
        plain: list[dict[str, float]] = []
        ref, tok = mlx_lm.load(str(model_dir))
        run(ref, tok, prompt, 4)  # warm up (compile, page cache)
        for rep in range(args.repeats):
            t0 = time.perf_counter()
            base = run(ref, tok, prompt, args.tokens)
            plain.append(base)
            for experts, name, share in configs:
                arena = max(minimum, int(total * share))
                model, mtok = load(str(model_dir), pack_path=pack, arena_bytes=arena,
                                   config=config, experts=experts, progress=False)  # fmt: skip
                try:
                    run(model, mtok, prompt, 4)  # warm up
                    model.strata_engine.window.reset_stats()
                    r = run(model, mtok, prompt, args.tokens)
                    s = model.strata_engine.window.stats()["total"]
                finally:
                    model.strata_engine.close()
                r["prompt_ratio"] = r["prompt_tps"] / base["prompt_tps"]
                r["decode_ratio"] = r["decode_tps"] / base["decode_tps"]
                r["hit_rate"] = s["hit_rate"] or 0.0
                r["mb_read"] = s["bytes_read"] / 1e6
                r["stall_ms_per_token"] = s["stall_seconds"] * 1e3 / max(1, s["tokens"])
                results[name].append(r)
            print(f"repeat {rep + 1}/{args.repeats} in {time.perf_counter() - t0:.1f} s")

    def spread(values: list[float]) -> str:
        return f"{statistics.median(values):.3g} [{min(values):.3g}, {max(values):.3g}]"

    print(f"\nmodel {model_dir}, {args.tokens} decode tokens, prompt {args.prompt_words} words, "
          f"{args.repeats} repeats: median [min, max]")  # fmt: skip
    print(f"plain mlx-lm   prompt {spread([b['prompt_tps'] for b in plain])} tok/s   "
          f"decode {spread([b['decode_tps'] for b in plain])} tok/s")  # fmt: skip
    for name, rs in results.items():
        print(
            f"{name:<14} prompt x{spread([r['prompt_ratio'] for r in rs])}   "
            f"decode x{spread([r['decode_ratio'] for r in rs])}   "
            f"hit {spread([r['hit_rate'] for r in rs])}   "
            f"read {spread([r['mb_read'] for r in rs])} MB   "
            f"stall {spread([r['stall_ms_per_token'] for r in rs])} ms/token"
        )


if __name__ == "__main__":
    main()
