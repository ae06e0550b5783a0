"""Streamed experts on 1 rank against 2 ranks (pipeline and tensor parallel) on loopback.

    python benchmarks/distributed.py --json distributed.json
    python benchmarks/distributed.py --repeats 3 --tokens 32 --arena-share 0.5 --layers 12

The model is a random qwen3_moe (strata_stream.mlx_lm.random_model.make_large_checkpoint) with
hidden 1024, moe_intermediate 512 (256 per tensor rank: four whole q4 groups of 64), 64
experts, top-8, over --layers layers: about 57 MB of experts per layer, built once into the
cache. Each configuration is one `mlx.launch -n N --backend ring` on loopback of this script
(the hidden --rank flag), the ranks loading with strata_stream.mlx_lm.sharded_load:

- "1 rank": the whole model in one process;
- "pipeline x2": each rank runs and streams half of the layers;
- "tensor x2": each rank holds and streams half of every expert.

Every rank's arena is --arena-share (0.1) of its own share's experts (so a tensor rank's arena
is half the single rank's, a pipeline rank's holds half the layers), so the experts stream. Per
rank: a short warm-up generation, then --tokens tokens sampled at temperature 1 from seed 0 on
every rank (a random model's greedy text soon repeats itself and would stop streaming); decode
tokens/s (mlx-lm's figure, rank 0), bytes read per decode token, hit rate and peak RSS
(strata_stream.process_memory.peak_bytes at exit: the rank's own VmHWM on Linux). The
configurations run interleaved over --repeats. On one machine the ranks share its cores and its
SSD: the ratios say what splitting costs or saves here, not what two Macs would do.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from strata_stream.process_memory import peak_bytes

DIMS: dict[str, Any] = {
    "hidden_size": 1024,
    "moe_intermediate_size": 512,
    "intermediate_size": 512,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
CONFIGS = (("1 rank", "tensor", 1), ("pipeline x2", "pipeline", 2), ("tensor x2", "tensor", 2))
PROMPT = " ".join(f"w{(i * 7) % 60}" for i in range(24))


def default_model(layers: int) -> Path:
    from strata_stream.mlx_lm.random_model import make_large_checkpoint
    from strata_stream.paths import cache_dir

    path = cache_dir() / "models" / f"qwen3-moe-dist-bench-{layers}L"
    if not (path / ".complete").exists():
        print(f"building {path} (once)", flush=True)
        make_large_checkpoint(path, num_layers=layers, dims=DIMS)
        (path / ".complete").write_text("")
    return path


def rank_main(a: argparse.Namespace) -> int:
    """One rank of one configuration (under mlx.launch)."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream, stream_generate
    from mlx_lm.sample_utils import make_sampler

    from strata_stream.config import StreamConfig
    from strata_stream.errors import ConfigError
    from strata_stream.mlx_lm.distributed import sharded_load
    from strata_stream.pack.reader import ExpertPack

    group = mx.distributed.init(strict=False)
    kw = {"pipeline_group": group} if a.mode == "pipeline" else {"tensor_group": group}
    cfg = StreamConfig.from_env()
    # First the rank's pack (converted on first use) to size the arena from its share.
    model, tok = sharded_load(a.model, **kw, config=cfg, progress=False)
    pack_path = model.strata_pack_path
    with ExpertPack.open(pack_path) as pack:
        share_bytes = pack.n_records * pack.record_stride
        minimum = 2 * pack.geometry.top_k * pack.record_stride
    model.strata_engine.close()
    del model
    arena = max(minimum, int(a.arena_share * share_bytes))
    try:
        model, tok = sharded_load(a.model, **kw, config=cfg, arena_bytes=arena, progress=False)
    except ConfigError as e:
        print(f"rank {group.rank()}: {e}", file=sys.stderr)
        return 1
    window = model.strata_engine.window
    for _ in stream_generate(model, tok, PROMPT, max_tokens=4):  # warm-up
        pass
    # Every rank has the same logits (all_gather / all_sum), so the same seed samples the same
    # tokens everywhere, as the ranks' collectives require.
    mx.random.seed(0)
    sampler = make_sampler(temp=1.0)
    mx.synchronize(generation_stream)
    before = None
    last = None
    t0 = time.perf_counter()
    for r in stream_generate(model, tok, PROMPT, max_tokens=a.tokens, sampler=sampler):
        if before is None:
            before = window.stats()["total"]
        last = r
    mx.synchronize(generation_stream)
    wall = time.perf_counter() - t0
    after = window.stats()["total"]
    assert before is not None and last is not None
    decode = max(1, last.generation_tokens - 1)
    row = {
        "rank": group.rank(),
        "size": group.size(),
        "decode_tokens_per_s": last.generation_tps,
        "prompt_tokens_per_s": last.prompt_tps,
        "wall_s": wall,
        "bytes_read_per_token": (after["bytes_read"] - before["bytes_read"]) / decode,
        "hit_rate": (after["hits"] - before["hits"])
        / max(1, after["hits"] + after["misses"] - before["hits"] - before["misses"]),
        "arena_bytes": arena,
        "share_bytes": share_bytes,
        "pack_bytes": Path(pack_path).stat().st_size,
        "peak_rss_bytes": peak_bytes(),
    }
    model.strata_engine.close()
    mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu))  # leave together
    Path(a.out, f"rank{group.rank()}.json").write_text(json.dumps(row))
    return 0


def launch(model: Path, mode: str, n: int, tokens: int, share: float, timeout: float) -> list[Any]:
    from strata_stream.mlx_lm.launch import run_ranks

    with tempfile.TemporaryDirectory() as out:
        args = [__file__, "--rank", "--model", str(model), "--mode", mode, "--out", out,
                "--tokens", str(tokens), "--arena-share", str(share)]  # fmt: skip
        import strata_stream

        # The ranks import the strata_stream this process imported.
        root = str(Path(strata_stream.__file__).resolve().parents[1])
        env = {"PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
        r = run_ranks(args, n=n, timeout=timeout, env=env)
        if r.timed_out or r.returncode != 0:
            raise RuntimeError(f"{mode} x{n} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
        return [json.loads(Path(out, f"rank{i}.json").read_text()) for i in range(n)]


def _ratio(x: float, base: float) -> str:
    return f"x{x / base:.2f}" if base else "-"


def _spread(xs: list[float], fmt: str = "{:.2f}") -> str:
    med = statistics.median(xs)
    return f"{fmt.format(med)} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, help="qwen3_moe-style checkpoint (default: built once)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=24, help="decode tokens per run (24)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--arena-share", type=float, default=0.1,
                   help="each rank's arena as a share of its experts (0.1)")  # fmt: skip
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per launch")
    p.add_argument("--json", type=Path, help="write the rows and the summary here")
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.rank:
        return rank_main(a)

    model = a.model or default_model(a.layers)
    for _, mode, n in CONFIGS:  # convert every rank's pack once, untimed
        launch(model, mode, n, 2, a.arena_share, a.timeout)
    runs: dict[str, list[list[Any]]] = {name: [] for name, _, _ in CONFIGS}
    for rep in range(a.repeats):
        for name, mode, n in CONFIGS:
            ranks = launch(model, mode, n, a.tokens, a.arena_share, a.timeout)
            runs[name].append(ranks)
            print(f"repeat {rep + 1} {name}: {ranks[0]['decode_tokens_per_s']:.2f} tok/s",
                  flush=True)  # fmt: skip

    base = statistics.median(r[0]["decode_tokens_per_s"] for r in runs["1 rank"])
    base_bytes = statistics.median(r[0]["bytes_read_per_token"] for r in runs["1 rank"])
    summary: dict[str, Any] = {}
    print("\n| configuration | decode tok/s (rank 0) | vs 1 rank | rank | MB read / token | "
          "vs 1 rank | hit % | arena MB | pack MB | peak RSS MB |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, _, n in CONFIGS:
        tps = [r[0]["decode_tokens_per_s"] for r in runs[name]]
        entry: dict[str, Any] = {
            "decode_tokens_per_s": tps,
            "ratio_vs_1_rank": statistics.median(tps) / base,
            "ranks": [],
        }
        for k in range(n):
            read = [r[k]["bytes_read_per_token"] for r in runs[name]]
            rss = [r[k]["peak_rss_bytes"] for r in runs[name]]
            first = runs[name][0][k]
            entry["ranks"].append({
                "bytes_read_per_token": read,
                "bytes_ratio_vs_1_rank": (statistics.median(read) / base_bytes) if base_bytes
                else None,
                "hit_rate": [r[k]["hit_rate"] for r in runs[name]],
                "peak_rss_bytes": rss,
                "arena_bytes": first["arena_bytes"],
                "pack_bytes": first["pack_bytes"],
            })  # fmt: skip
            print(f"| {name} | {_spread(tps) if k == 0 else ''} | "
                  f"{'x%.2f' % (statistics.median(tps) / base) if k == 0 else ''} | {k} | "
                  f"{_spread([x / 1e6 for x in read])} | "
                  f"{_ratio(statistics.median(read), base_bytes)} | "
                  f"{_spread([r[k]['hit_rate'] * 100 for r in runs[name]], '{:.0f}')} | "
                  f"{first['arena_bytes'] / 1e6:.0f} | {first['pack_bytes'] / 1e6:.0f} | "
                  f"{_spread([x / 1e6 for x in rss], '{:.0f}')} |")  # fmt: skip
        summary[name] = entry
    print("\nOne 2-core machine: the ranks of a launch share its cores and SSD, so the tok/s "
          "ratios are what splitting costs here, not what separate Macs would give.")  # fmt: skip
    if a.json:
        a.json.write_text(json.dumps({"model": str(model), "layers": a.layers, "tokens": a.tokens,
                                      "repeats": a.repeats, "arena_share": a.arena_share,
                                      "summary": summary, "runs": runs}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
