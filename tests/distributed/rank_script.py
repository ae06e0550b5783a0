"""One rank of the distributed tests, run by `mlx.launch -n 2 --backend ring` (see launch.py).

On every rank: plain sharded mlx-lm (mlx_lm.utils.sharded_load) and the streamed model
(strata_stream.mlx_lm.distributed.sharded_load) on the same checkpoint and group, each giving
teacher-forced logits of a fixed token sequence and greedy tokens; then the streamed rank's pack
and engine figures, and their sum over ranks. Written as JSON to OUT/rank{r}.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx


def run(model: Any, tokens: list[int], max_tokens: int) -> tuple[list[list[float]], list[int]]:
    from mlx_lm.generate import generate_step, generation_stream

    logits = model(mx.array([tokens]))
    mx.eval(logits)
    forced = logits[0].astype(mx.float32).tolist()
    greedy: list[int] = []
    for tok, _ in generate_step(
        mx.array(tokens), model, max_tokens=max_tokens, sampler=lambda x: mx.argmax(x, axis=-1)
    ):
        greedy.append(int(tok))
    # generate_step leaves one step (with its collectives) in flight: drain it before the next
    # collective on another stream (a load's barrier, sum_stats).
    mx.synchronize(generation_stream)
    return forced, greedy


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--mode", choices=("pipeline", "tensor"), required=True)
    p.add_argument("--experts", choices=("cpu", "mlx"), required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", required=True)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--no-plain", action="store_true")
    p.add_argument("--poisoned", help="a copy of the checkpoint with NaN expert tensors")
    a = p.parse_args()

    from mlx_lm.utils import sharded_load as plain_sharded_load

    from strata_stream.config import StreamConfig
    from strata_stream.mlx_lm.distributed import rank_stats, sharded_load, sum_stats
    from strata_stream.pack.reader import ExpertPack

    group = mx.distributed.init(strict=True, backend="ring")
    groups: dict[str, Any] = {f"{a.mode}_group": group}
    tokens = [int(t) for t in a.tokens.split(",")]
    result: dict[str, Any] = {"rank": group.rank(), "size": group.size()}

    if not a.no_plain:
        plain, _ = plain_sharded_load(a.checkpoint, **groups)
        result["plain_logits"], result["plain_greedy"] = run(plain, tokens, a.max_tokens)
        del plain

    # No speculation and no profile carried over between runs: every read is a demand miss, so
    # bytes read = misses x record bytes, which the test compares with a single-process run.
    cfg = StreamConfig(lookahead=False, profile_prefetch=False, persist_profile=False,
                       io_threads=2, direct_io=False)  # fmt: skip
    model, _ = sharded_load(
        a.checkpoint, **groups, experts=a.experts, config=cfg, arena_bytes=None, progress=False
    )
    result["logits"], result["greedy"] = run(model, tokens, a.max_tokens)
    stats = rank_stats(model)
    result["stats"] = stats
    result["summed"] = sum_stats(stats)
    engine = model.strata_engine
    if engine is not None:
        with ExpertPack.open(model.strata_pack_path) as pack:
            g = pack.geometry
            result["pack"] = {
                "path": str(pack.path),
                "n_layers": g.n_layers,
                "moe_intermediate": g.moe_intermediate,
                "record_bytes": pack.record_bytes,
                "record_stride": pack.record_stride,
                "file_bytes": pack.file_bytes,
                "records_offset": pack.records_offset,
                "model": pack.metadata.get("model"),
            }
        result["local_moe_layers"] = [b.decoder_layer for b in engine.blocks]
    if a.poisoned:
        # The same rank's pack, the checkpoint's expert tensors NaN: the sharding of the lazy
        # expert tensors must never be evaluated, so the logits stay the same.
        poisoned, _ = sharded_load(a.poisoned, **groups, experts=a.experts, config=cfg,
                                   pack_path=model.strata_pack_path, progress=False)  # fmt: skip
        out = poisoned(mx.array([tokens]))
        mx.eval(out)
        result["poisoned_logits"] = out[0].astype(mx.float32).tolist()
    Path(a.out, f"rank{group.rank()}.json").write_text(json.dumps(result))
    print(f"rank {group.rank()} done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
