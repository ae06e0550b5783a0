"""`strata-stream demo`: a real mlx-lm generation with streamed experts, offline.

Builds a random-weight mlx-lm MoE checkpoint (q4, as `mlx_lm.convert -q` writes it), converts
its experts into a pack, then generates the same prompt with plain mlx-lm and with the experts
streaming through an arena a fraction of their size, and prints both side by side with the
engine's figures. Runs in well under a minute on two cores. Both expert paths (MLX's kernels
over the arena, and the CPU backend reproducing MLX's arithmetic) are bitwise identical to plain
mlx-lm: the demo exits 1 if either generates a different token.

`--keep DIR` keeps the checkpoint (DIR/FAMILY, a model directory like any other) and converts
its pack into the cache, where `generate`, `serve` and `load` find it: a local model to try the
commands on offline.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _generate(model: Any, tokenizer: Any, prompt: str, n: int) -> tuple[str, list[int], float]:
    from mlx_lm.generate import stream_generate

    text, tokens, tps = "", [], 0.0
    for r in stream_generate(model, tokenizer, prompt, max_tokens=n):
        text += r.text
        tokens.append(int(r.token))
        tps = r.generation_tps
    return text, tokens, tps


def main(argv: Sequence[str] | None = None) -> int:
    from strata_stream.config import StreamConfig
    from strata_stream.convert import convert
    from strata_stream.convert.pack_cache import ensure_pack
    from strata_stream.errors import ConfigError
    from strata_stream.mlx_lm.loader import load
    from strata_stream.mlx_lm.random_model import CONFIGS, VOCAB, make_checkpoint

    p = argparse.ArgumentParser(prog="strata-stream demo", description=__doc__)
    p.add_argument("--family", choices=list(CONFIGS), default="qwen3_moe")
    p.add_argument("--tokens", type=int, default=24, help="tokens to generate (24)")
    p.add_argument("--arena-share", type=float, default=0.25,
                   help="arena size as a share of all experts (0.25)")  # fmt: skip
    p.add_argument("--experts", choices=("both", "cpu", "mlx"), default="both")
    p.add_argument("--keep", metavar="DIR", default=None,
                   help="keep the checkpoint in DIR/FAMILY (its pack in the cache) to use "
                   "offline")  # fmt: skip
    args = p.parse_args(argv)
    dims: dict[str, Any] = {"hidden_size": 128, "num_hidden_layers": 4}
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if key in CONFIGS[args.family]:
            dims[key] = 16
    for key in ("moe_intermediate_size", "intermediate_size"):
        if key in CONFIGS[args.family]:
            dims[key] = 128
    prompt = " ".join(VOCAB[i * 7 % len(VOCAB)] for i in range(12))
    with contextlib.ExitStack() as scope:
        if args.keep is None:
            tmp = Path(scope.enter_context(tempfile.TemporaryDirectory(prefix="strata-demo-")))
        else:
            tmp = Path(args.keep).expanduser()
            if (tmp / args.family).exists():
                raise ConfigError(f"--keep {args.keep}: {tmp / args.family} exists already; "
                                  "name another directory (nothing is replaced)")  # fmt: skip
            tmp.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        model_dir = make_checkpoint(args.family, tmp / args.family, dims=dims)
        if args.keep is None:
            pack = convert(model_dir, tmp / "experts.strpk", progress=False)
        else:  # where generate, serve and load look for it
            pack = ensure_pack(model_dir.resolve(), progress=False)
        print(f"random {args.family} checkpoint and its pack ready in "
              f"{time.perf_counter() - t0:.1f} s")  # fmt: skip

        from mlx_lm.utils import load as mlx_load

        loaded: Any = mlx_load(str(model_dir))
        ref, tokenizer = loaded[0], loaded[1]
        ref_text, ref_tokens, ref_tps = _generate(ref, tokenizer, prompt, args.tokens)
        del ref, loaded
        print(f"prompt:      {prompt}")
        print(f"mlx-lm:      {ref_text}   ({ref_tps:.1f} tok/s, every expert in memory)")

        from strata_stream.pack.reader import ExpertPack

        with ExpertPack.open(pack) as pk:
            total = pk.geometry.n_records * pk.record_stride
            arena = max(int(total * args.arena_share), 2 * pk.geometry.top_k * pk.record_stride)
        config = StreamConfig.from_env(direct_io=False, persist_profile=False)
        status = 0
        for experts in ("mlx", "cpu") if args.experts == "both" else (args.experts,):
            model, tok = load(str(model_dir), pack_path=pack, arena_bytes=arena, config=config,
                              experts=experts, progress=False)  # fmt: skip
            try:
                text, tokens, tps = _generate(model, tok, prompt, args.tokens)
                stats = model.strata_engine.window.stats()["total"]
                n_slots = model.strata_engine.stream.n_slots
            finally:
                model.strata_engine.close()
            same = sum(a == b for a, b in zip(ref_tokens, tokens, strict=False))
            if tokens != ref_tokens:
                status = 1
            note = {
                "mlx": "MLX's own kernels over the arena: bitwise mlx-lm",
                "cpu": "the CPU backend in MLX's arithmetic: bitwise mlx-lm",
            }[experts]
            hit, recall = stats["hit_rate"], stats["recall"]
            print(f"streamed:    {text}   ({tps:.1f} tok/s, experts on {experts})")
            print(f"  tokens identical to mlx-lm: {same}/{len(ref_tokens)} ({note})")
            print(
                f"  arena {arena / total:.0%} of the experts ({n_slots} slots): hit rate "
                f"{'n/a' if hit is None else f'{hit:.1%}'}, {stats['bytes_read'] / 1e6:.1f} MB "
                f"read, stall {stats['stall_seconds'] * 1e3:.0f} ms, prediction recall "
                f"{'n/a' if recall is None else f'{recall:.1%}'}"
            )
    if args.keep is not None:
        kept = shlex.quote(str(model_dir))
        print(f"kept {model_dir} (its pack: {pack}); try: strata-stream generate {kept} "
              f"--prompt {shlex.quote(prompt)}")  # fmt: skip
    if status:
        print("FAILED: the streamed model must generate exactly mlx-lm's tokens")
    return status
