"""CPU backend kernels on the qwen3-30b-a3b geometry: GFLOP/s and GB/s per kernel.

    python benchmarks/cpu_kernels.py [--pack P] [--rows 1 64] [--json OUT]

Each kernel of one MoE layer call runs alone on the CPU backend (submit + synchronize, median of
--repeats) with every expert of the layer resident, for decode (1 row) and a prompt chunk.
FLOPs count multiply-adds as two; GB/s counts the expert weight bytes the kernel reads (each
chosen expert once), which is what bounds decode.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from common import ensure_pack
from strata_stream import ExpertPack, _bench


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--pack", type=Path, help="default: packs/qwen3-30b-a3b.strpk (packed once)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="0 = every core")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    path = ensure_pack(args.pack)
    with ExpertPack.open(path) as pack:
        g = pack.geometry
        fmt = pack.weight_format
    rows_out = []
    print(
        f"{path.name}: {fmt}, hidden {g.hidden}, moe_intermediate {g.moe_intermediate}, "
        f"top-{g.top_k} of {g.n_experts}"
    )
    print(f"{'rows':>5} {'kernel':>8} {'ms':>9} {'GFLOP/s':>8} {'GB/s':>7}")
    for rows in args.rows:
        # Every expert of layer 0 resident in an arena of its own (one slot to spare).
        for k in _bench.bench_kernels(
            str(path), layer=0, rows=rows, repeats=args.repeats, threads=args.threads
        ):
            sec = k["seconds"]
            gflops = k["flops"] / sec / 1e9 if k["flops"] else None
            gbps = k["weight_bytes"] / sec / 1e9 if k["weight_bytes"] else None
            rows_out.append(
                {
                    "rows": rows,
                    "kernel": k["op"],
                    "seconds": sec,
                    "gflops": gflops,
                    "gbps": gbps,
                }
            )
            print(
                f"{rows:>5} {k['op']:>8} {sec * 1e3:>9.3f} "
                f"{gflops if gflops is not None else float('nan'):>8.2f} "
                f"{gbps if gbps is not None else float('nan'):>7.2f}"
            )
    if args.json:
        args.json.write_text(json.dumps({"format": fmt, "rows": rows_out}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
