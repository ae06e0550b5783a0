"""Decode tokens/s against the ceiling the SSD and the compute allow, measured in one run.

    python benchmarks/decode.py [--pack P] [--json OUT] [--tokens N]
    python benchmarks/decode.py --verify-cost [--fractions 0.1] [--repeats 4] [--buffered]

On the qwen3-30b-a3b preset with O_DIRECT, for arenas of 10, 25, 50 and 100% of the experts and
next-layer prediction off and on: a short prompt warms the stream, then --tokens decode steps of
the synthetic driver are timed. Beside each figure stands its ceiling,

    1 / max(missed bytes per token / raw device bandwidth, seconds per token all-resident),

with the raw bandwidth measured by fio (engine part size and queue depth) right before each row,
because this class of cloud disk swings between 0.4 and 1.5 GB/s from one minute to the next, and
the all-resident seconds per token measured by replaying the same tokens with every expert they
touch already resident. fraction_of_ceiling is tokens/s over that ceiling.

--verify-cost: what checking every read's CRC32C costs (StreamConfig.verify_reads). For each
arena fraction, decode runs with verification off and on, alternating which goes first, --repeats
pairs; prints tokens/s of both, each pair's on/off ratio and their median and spread. --buffered
reads through the page cache instead of O_DIRECT: with the pack cached that is the fast-device
case, where the checksum is the largest share of a read's cost.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from common import ensure_pack, raw_read
from strata_stream import ExpertPack, ExpertStream, StreamConfig, Window
from strata_stream.synthetic import SyntheticDriver


def decode_run(
    path: Path,
    pack: ExpertPack,
    config: StreamConfig,
    prompt: int,
    tokens: int,
    seed: int,
    replay: bool = False,
    backend: str = "cpu",
) -> dict[str, Any]:
    """Times `tokens` decode steps after a `prompt` on `backend` (Window's name for it).
    replay: run everything once untimed first, so the timed pass finds every expert it needs
    resident (the all-resident baseline)."""
    g = pack.geometry
    with ExpertStream(path, config) as stream, Window(stream, backend=backend) as window:
        passes = 2 if replay else 1
        for p in range(passes):
            driver = SyntheticDriver(g, pack.router_weights, seed=seed)
            x = driver.prompt(prompt)
            with window.turn():
                for layer in range(g.n_layers):
                    window.moe(layer, x.layer_input(layer))
            inputs = []
            for _ in range(tokens):
                t = driver.decode()
                inputs.append([t.layer_input(layer) for layer in range(g.n_layers)])
            window.reset_stats()
            before = stream.stats()
            t0 = time.perf_counter()
            with window.turn():
                for xs in inputs:
                    for layer in range(g.n_layers):
                        window.moe(layer, xs[layer])
            wall = time.perf_counter() - t0
            if p + 1 < passes:
                continue
            after = stream.stats()
            total = window.stats()["total"]
            return {
                "seconds_per_token": wall / tokens,
                "tokens_per_s": tokens / wall,
                "missed_bytes_per_token": total["bytes_read"] / tokens,
                "bytes_read_per_token": (after["bytes_read"] - before["bytes_read"]) / tokens,
                "hit_rate": total["hit_rate"],
                "stall_s_per_token": total["stall_seconds"] / tokens,
                "handshake_s_per_token": total["handshake_seconds"] / tokens,
                "recall": total["recall"],
            }
    raise AssertionError("unreachable")


def verify_cost(
    path: Path, pack: ExpertPack, base: StreamConfig, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Decode tokens/s with verify_reads off and on, side by side, interleaved."""
    g = pack.geometry
    n_all = g.n_layers * g.n_experts
    rows = []
    for fraction in args.fractions:
        n_slots = max(2 * g.top_k, int(n_all * fraction))
        config = base.replace(arena_bytes=n_slots * pack.record_stride)
        tps: dict[bool, list[float]] = {False: [], True: []}
        mb: dict[bool, list[float]] = {False: [], True: []}
        ratios = []
        for rep in range(args.repeats):
            order = (False, True) if rep % 2 == 0 else (True, False)
            for verify in order:
                r = decode_run(
                    path,
                    pack,
                    config.replace(verify_reads=verify),
                    args.prompt,
                    args.tokens,
                    args.seed + rep,
                )
                tps[verify].append(r["tokens_per_s"])
                mb[verify].append(r["bytes_read_per_token"] / 1e6)
            ratios.append(tps[True][-1] / tps[False][-1])
            print(
                f"arena {fraction:4.0%} pair {rep}: verify off {tps[False][-1]:6.3f} tok/s, "
                f"on {tps[True][-1]:6.3f} tok/s, on/off {ratios[-1]:.3f} "
                f"(read off {mb[False][-1]:.0f}, on {mb[True][-1]:.0f} MB/token)",
                flush=True,
            )
        med = statistics.median(ratios)
        row = {
            "arena_fraction": fraction,
            "direct_io": config.direct_io,
            "tokens_per_s_verify_off": tps[False],
            "tokens_per_s_verify_on": tps[True],
            "ratio_on_off": ratios,
            "mb_read_per_token_verify_off": mb[False],
            "mb_read_per_token_verify_on": mb[True],
            "median_ratio": med,
            "cost": 1 - med,
        }
        rows.append(row)
        print(
            f"arena {fraction:4.0%}: verify on/off median {med:.3f} "
            f"(pairs {min(ratios):.3f}-{max(ratios):.3f}); cost {100 * (1 - med):+.1f}% of "
            "decode tokens/s"
        )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--pack", type=Path)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.10, 0.25, 0.50, 1.00])
    ap.add_argument("--io-threads", type=int, default=StreamConfig.io_threads)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--verify-cost", action="store_true", help="verify_reads off vs on")
    ap.add_argument("--repeats", type=int, default=4, help="--verify-cost: pairs per fraction")
    ap.add_argument("--buffered", action="store_true", help="page-cache reads, not O_DIRECT")
    args = ap.parse_args()
    path = ensure_pack(args.pack)
    with ExpertPack.open(path) as pack:
        g = pack.geometry
        stride = pack.record_stride
        n_all = g.n_layers * g.n_experts
        base = StreamConfig.from_env(io_threads=args.io_threads, direct_io=not args.buffered)
        if args.verify_cost:
            rows = verify_cost(path, pack, base, args)
            if args.json:
                args.json.write_text(json.dumps({"verify_cost": rows}, indent=2) + "\n")
            return 0
        raw_offset = pack.records_offset + n_all // 2 * stride

        def raw_bandwidth() -> float:
            nonlocal raw_offset
            raw_offset += 1 << 29  # a fresh region each time
            if raw_offset + (1 << 29) > pack.file_bytes:
                raw_offset = pack.records_offset
            return raw_read(path, raw_offset, 1 << 29, base.part_bytes, args.io_threads)

        resident = decode_run(
            path,
            pack,
            base.replace(arena_bytes=n_all * stride, lookahead=False),
            args.prompt,
            args.tokens,
            args.seed,
            replay=True,
        )
        compute_s = resident["seconds_per_token"]
        print(f"all-resident: {1 / compute_s:.2f} tok/s ({compute_s * 1e3:.0f} ms/token)")
        rows = []
        for fraction in args.fractions:
            for lookahead in (False, True):
                n_slots = max(2 * g.top_k, int(n_all * fraction))
                raw = raw_bandwidth()
                r = decode_run(
                    path,
                    pack,
                    base.replace(arena_bytes=n_slots * stride, lookahead=lookahead),
                    args.prompt,
                    args.tokens,
                    args.seed,
                )
                ceiling = 1 / max(r["bytes_read_per_token"] / raw, compute_s)
                row = {
                    "arena_fraction": fraction,
                    "lookahead": lookahead,
                    "raw_gbps": raw / 1e9,
                    "tokens_per_s": r["tokens_per_s"],
                    "ceiling_tokens_per_s": ceiling,
                    "fraction_of_ceiling": r["tokens_per_s"] / ceiling,
                    **r,
                }
                rows.append(row)
                print(
                    f"arena {fraction:4.0%} lookahead {'on ' if lookahead else 'off'} "
                    f"(raw {raw / 1e9:.2f} GB/s): "
                    f"{r['tokens_per_s']:6.2f} tok/s, ceiling {ceiling:6.2f} "
                    f"({row['fraction_of_ceiling']:.2f}); hit rate {r['hit_rate']:.3f}, "
                    f"read {r['bytes_read_per_token'] / 1e6:.0f} MB/token, stall "
                    f"{r['stall_s_per_token'] * 1e3:.0f} ms/token, recall {r['recall']}"
                )
    if args.json:
        args.json.write_text(
            json.dumps(
                {"all_resident_tokens_per_s": 1 / compute_s, "rows": rows},
                indent=2,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
