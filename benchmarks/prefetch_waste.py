"""Unused speculative reads in decode: the share of prefetched experts no request used.

    python benchmarks/prefetch_waste.py [--share 0.25] [--tokens 256] [--seed 0] [--dir DIR]

A random qwen3_moe checkpoint (transformers front-end, 12 layers, 64 experts, top 8, written
once under --dir) decodes --tokens random tokens after an 8-token prompt with an arena of
--share of its pack; prints the stream's speculative reads started and used over the decode,
the unused fraction, urgent misses, bytes read, and the prefetch governor's per-layer caps.
Random weights predict the next layer about as well as the peer benchmark's model does.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--share", type=float, default=0.25)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/strata-prefetch-waste"))
    a = ap.parse_args()
    import torch

    from strata_stream import StreamConfig
    from strata_stream.pack.reader import ExpertPack
    from strata_stream.transformers import load
    from strata_stream.transformers.random_model import make_checkpoint

    ckpt = a.dir / "ckpt"
    if not (ckpt / "config.json").exists():
        dims = {"num_hidden_layers": 12, "num_experts": 64, "num_experts_per_tok": 8,
                "hidden_size": 128, "moe_intermediate_size": 256, "head_dim": 32}  # fmt: skip
        make_checkpoint("qwen3_moe", ckpt, dims=dims)
    os.environ.setdefault("STRATA_CACHE", str(a.dir / "cache"))
    whole = load(str(ckpt), progress=False, arena_bytes=1 << 40)  # converts the pack once
    with ExpertPack.open(whole.strata_pack_path) as pack:
        total = pack.geometry.n_records * pack.record_stride
    whole.strata_engine.close()
    cfg = StreamConfig.from_env().replace(io_threads=2, direct_io=False, persist_profile=False)
    model = load(str(ckpt), progress=False, arena_bytes=int(total * a.share), config=cfg)
    ids = torch.randint(2, 60, (1, 8 + a.tokens), generator=torch.Generator().manual_seed(a.seed))
    stream = model.strata_engine.stream
    with torch.no_grad():
        out = model(input_ids=ids[:, :8], use_cache=True)
        before = stream.stats()
        for i in range(a.tokens):
            out = model(input_ids=ids[:, 8 + i : 9 + i], use_cache=True,
                        past_key_values=out.past_key_values)  # fmt: skip
    after = stream.stats()
    keys = ("spec_requests", "spec_hits", "misses", "hits", "bytes_read")
    row = {k: after[k] - before[k] for k in keys}
    row["unused"] = 1 - row["spec_hits"] / max(1, row["spec_requests"])
    prefetch = model.strata_engine.window.stats()["prefetch"]
    row["layer_caps"] = prefetch.get("layer_caps")
    print(json.dumps({"share": a.share, "tokens": a.tokens, "seed": a.seed, **row}))


if __name__ == "__main__":
    main()
