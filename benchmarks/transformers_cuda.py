"""load(device="cuda") against plain transformers on the same GPU: decode and prompt tokens/s.

    python benchmarks/transformers_cuda.py [--layers 2] [--fractions 1 0.25 0.1] [--waiting]
        [--json OUT]

A check of the CUDA path (docs/transformers.md), not the end-to-end benchmark
(benchmarks/transformers_e2e.py): random qwen3_moe weights with Qwen3-30B-A3B's routed experts
(hidden 2048, moe_intermediate 768, 128 experts, top-8), bfloat16, --layers layers, attention and
vocabulary tiny, built by transformers' own classes into the cache directory and converted once.
Plain transformers on CUDA with eager and grouped_mm experts, then streamed at each arena
fraction (of every expert), each after a warm-up: greedy generate of --tokens after a
--prompt-tokens prompt, torch synchronized around each timing. GPU memory: torch's peak
allocation (dense weights, KV cache, activations) and, streamed, the arena's device mirror,
which the cuda backend allocates outside torch. --waiting also runs each arena with the experts
calls waiting for the backend's kernels (no stream given: each call returns once its output is
complete, as before the queued completion), before the default run, in the same process.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from strata_stream import ExpertPack, StreamConfig
from strata_stream.convert.pack_cache import ensure_pack
from strata_stream.paths import cache_dir
from strata_stream.transformers import load
from strata_stream.transformers.random_model import make_checkpoint

DIMS = {"hidden_size": 2048, "moe_intermediate_size": 768, "intermediate_size": 768,
        "num_experts": 128, "num_experts_per_tok": 8}  # fmt: skip


def _model_dir(layers: int) -> Path:
    path = cache_dir() / "bench" / f"hf-qwen3-30b-a3b-experts-{layers}l-bf16"
    if not (path / "config.json").exists():
        make_checkpoint("qwen3_moe", path, dtype="bfloat16",
                        dims={**DIMS, "num_hidden_layers": layers})  # fmt: skip
    return path


def _timed(model: Any, prompt: torch.Tensor, new: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def _run(model: Any, prompt: torch.Tensor, tokens: int) -> tuple[float, float]:
    # Warm-up at the very lengths measured, on other tokens: a shape's first call (a decode step
    # at a sequence length not run before: ~80 ms against ~7 ms on the H200) is not the model's.
    _timed(model, torch.roll(prompt, 1, dims=1), tokens + 1)
    prefill = _timed(model, prompt, 1)
    total = _timed(model, prompt, tokens + 1)
    return prompt.shape[1] / prefill, tokens / max(1e-9, total - prefill)


def _waiting(call: Callable[..., None]) -> Callable[..., None]:
    """The engine's experts call without its stream: each call waits for its kernels."""

    def waiting_call(*a: Any, stream: int | None = None, **k: Any) -> None:
        call(*a, **k)

    return waiting_call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--fractions", type=float, nargs="*", default=[1.0, 0.25, 0.1])
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--waiting", action="store_true",
                        help="also each arena with calls that wait for their kernels")  # fmt: skip
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    path = _model_dir(args.layers)
    pack = ensure_pack(path, None, progress=False)
    with ExpertPack.open(pack) as p:
        everything = p.geometry.n_records * p.record_stride
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(2, 60, (1, args.prompt_tokens), generator=gen).cuda()
    rows: list[dict[str, Any]] = []

    def report(row: dict[str, Any]) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)

    for impl in ("eager", "grouped_mm"):
        torch.cuda.reset_peak_memory_stats()
        ref = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.bfloat16, experts_implementation=impl,
            device_map={"": torch.device("cuda", 0)},
        )  # fmt: skip
        pre, dec = _run(ref, prompt, args.tokens)
        report({"config": f"plain transformers ({impl})", "prompt_tps": pre, "decode_tps": dec,
                "torch_peak_gb": torch.cuda.max_memory_allocated() / 1e9})  # fmt: skip
        del ref
        torch.cuda.empty_cache()
    config = StreamConfig.from_env()
    runs = [(f, w) for f in args.fractions for w in ((True, False) if args.waiting else (False,))]
    for fraction, waiting in runs:
        torch.cuda.reset_peak_memory_stats()
        model = load(path, pack_path=pack, arena_bytes=int(everything * fraction),
                     dtype=torch.bfloat16, device="cuda", config=config,
                     progress=False)  # fmt: skip
        window = model.strata_engine.window
        if waiting:
            window.moe_routed_device = _waiting(window.moe_routed_device)  # type: ignore[method-assign]
        _run(model, prompt, 0)  # first touches of the experts, not measured
        window.reset_stats()
        pre, dec = _run(model, prompt, args.tokens)
        total = window.stats()["total"]
        name = f"streamed, arena {fraction:.0%}" + (", waiting" if waiting else "")
        report({"config": name, "prompt_tps": pre,
                "decode_tps": dec, "hit_rate": total["hit_rate"],
                "torch_peak_gb": torch.cuda.max_memory_allocated() / 1e9,
                "arena_gb": model.strata_engine.config.arena_bytes / 1e9})  # fmt: skip
        model.strata_engine.close()
        del model
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
