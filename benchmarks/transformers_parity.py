"""How far strata_stream.transformers is from plain transformers, per family: the figures
docs/transformers.md quotes (the tests assert bounds on the same quantities).

    python benchmarks/transformers_parity.py [--json OUT.json]

For every family: a tiny random checkpoint (strata_stream.transformers.random_model, float32
and bfloat16, written by save_pretrained), plain AutoModelForCausalLM (eager attention and
experts) against the streamed model with every expert resident, teacher-forced on a 20-token
prompt: max|logit diff| relative to max|logit| in float32; in bfloat16, the streamed model's
difference next to transformers' own bfloat16-vs-float32 difference on the same weights, and
the top-1 agreement.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from strata_stream import StreamConfig
from strata_stream.convert import convert
from strata_stream.transformers import load
from strata_stream.transformers.random_model import CONFIGS, make_checkpoint

PROMPT = [5, 9, 12, 3, 40, 22, 7, 8, 9, 10, 33, 2, 17, 61, 4, 4, 30, 12, 50, 6]
CONFIG = StreamConfig(io_threads=2, direct_io=False, persist_profile=False)


@torch.no_grad()
def _logits(model: Any) -> np.ndarray:
    return model(torch.tensor([PROMPT])).logits[0].float().numpy()


def _oracle(path: Path, dtype: str) -> Any:
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=getattr(torch, dtype), attn_implementation="eager",
        experts_implementation="eager",
    )  # fmt: skip


def measure(family: str, root: Path) -> dict[str, Any]:
    row: dict[str, Any] = {"family": family}
    for dtype in ("float32", "bfloat16"):
        path = make_checkpoint(family, root / f"{family}-{dtype}", dtype=dtype)
        pack = convert(path, root / f"{family}-{dtype}.strpk", progress=False)
        ref = _logits(_oracle(path, dtype))
        model = load(path, pack_path=pack, arena_bytes=1 << 26, config=CONFIG,
                     dtype=getattr(torch, dtype), attn_implementation="eager",
                     progress=False)  # fmt: skip
        got = _logits(model)
        model.strata_engine.close()
        scale = float(np.abs(ref).max())
        row[f"{dtype}_max_abs_logit"] = scale
        row[f"{dtype}_max_diff"] = float(np.abs(got - ref).max())
        row[f"{dtype}_top1_agreement"] = float((got.argmax(-1) == ref.argmax(-1)).mean())
        if dtype == "bfloat16":
            ref32 = _logits(_oracle(path, "float32"))
            row["transformers_bf16_vs_f32"] = float(np.abs(ref - ref32).max())
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in CONFIGS:
            r = measure(family, Path(tmp))
            rows.append(r)
            print(f"{family:<12} f32 {r['float32_max_diff']:.2e} "
                  f"({r['float32_max_diff'] / r['float32_max_abs_logit']:.1e} of max|logit|) | "
                  f"bf16 {r['bfloat16_max_diff']:.4f}, transformers' own bf16-vs-f32 "
                  f"{r['transformers_bf16_vs_f32']:.4f}, max|logit| "
                  f"{r['bfloat16_max_abs_logit']:.2f}, top-1 {r['bfloat16_top1_agreement']:.0%}",
                  flush=True)  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
