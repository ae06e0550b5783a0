"""End to end on the CPU: plain transformers vs strata_stream.transformers, one process.

    python benchmarks/transformers_e2e.py [--layers 2] [--fractions 0.5 0.25 0.1] [--json OUT]

The model is random qwen3_moe weights with Qwen3-30B-A3B's routed experts (hidden 2048,
moe_intermediate 768, 128 experts, top-8), bfloat16, --layers layers, attention and vocabulary
tiny; built once by transformers' own classes and save_pretrained into the cache directory and
converted once. Configurations: plain transformers (eager experts; grouped_mm where this torch
runs it) and streamed with every expert resident and at each --fractions share of the experts.
Prompt and decode tokens/s from model.generate (greedy, --prompt-tokens then --tokens), after a
short warm-up; the hit rate is the engine's over the whole measured run (warm-up, prompt and
decode). First cut of benchmarks for issue 18 item 7: no per-
configuration subprocess yet, so no peak RSS per configuration, and no CUDA.
"""

from __future__ import annotations

import argparse
import json
import time
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


def _run(model: Any, prompt: torch.Tensor, tokens: int) -> tuple[float, float]:
    with torch.no_grad():
        model.generate(prompt[:, :4], max_new_tokens=2, do_sample=False)  # warm-up
        t0 = time.perf_counter()
        model.generate(prompt, max_new_tokens=1, do_sample=False)
        t1 = time.perf_counter()
        model.generate(prompt, max_new_tokens=tokens + 1, do_sample=False)
        t2 = time.perf_counter()
    prefill = t1 - t0
    return prompt.shape[1] / prefill, tokens / max(1e-9, (t2 - t1) - prefill)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--fractions", type=float, nargs="*", default=[0.5, 0.25, 0.1])
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    path = _model_dir(args.layers)
    pack = ensure_pack(path, None, progress=True)
    with ExpertPack.open(pack) as p:
        everything = p.geometry.n_records * p.record_stride
    prompt = torch.randint(
        2, 60, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(0)
    )
    rows = []
    for impl in ("eager", "grouped_mm"):
        try:
            ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                       experts_implementation=impl)  # fmt: skip
            pre, dec = _run(ref, prompt, args.tokens)
        except Exception as e:  # noqa: BLE001 - an implementation this torch lacks is reported
            print(f"plain transformers ({impl}): not run: {type(e).__name__}: {e}")
            continue
        finally:
            ref = None
        rows.append({"config": f"plain transformers ({impl})", "prompt_tps": pre,
                     "decode_tps": dec})  # fmt: skip
        print(rows[-1], flush=True)
    config = StreamConfig.from_env()
    for fraction in (1.0, *args.fractions):
        model = load(path, pack_path=pack, arena_bytes=int(everything * fraction),
                     dtype=torch.bfloat16, config=config, progress=False)  # fmt: skip
        window = model.strata_engine.window
        _run(model, prompt, 0)  # first touches of the experts, not measured
        window.reset_stats()
        pre, dec = _run(model, prompt, args.tokens)
        total = window.stats()["total"]
        rows.append({"config": f"streamed, arena {fraction:.0%}", "prompt_tps": pre,
                     "decode_tps": dec, "hit_rate": total["hit_rate"]})  # fmt: skip
        print(rows[-1], flush=True)
        model.strata_engine.close()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
