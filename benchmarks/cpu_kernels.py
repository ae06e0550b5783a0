"""CPU backend expert passes against the host's memory bandwidth, per weight format.

    python benchmarks/cpu_kernels.py [--formats q4 q8 mxfp4 bf16] [--rows 1 64] [--json OUT]

For each format a one-layer pack at Qwen3-30B-A3B's expert widths (hidden 2048, intermediate
768, top-8 of 128; written once into packs/) has every expert resident, and each kernel of one
MoE layer call runs alone on the CPU backend (submit + synchronize, median of --repeats), for
decode (1 row: 8 experts) and a prompt chunk (64 rows: about 4 rows per expert).

Before each timed expert pass a buffer larger than the last-level cache is read, so the pass
finds its weights in memory, as a streamed layer does. Right before each (format, rows) set the
host's streaming read bandwidth (the "read" column, GB/s) is measured with the same thread count
(a plain sum over a buffer of the same size), and each pass's GB/s of weights (each chosen
expert's bytes once) is quoted as a ratio to that pair's bandwidth: the ratio is what the
kernels are held to, since the absolute figures move with the machine's load.

A virtual machine's memory bandwidth also moves with its host's other guests, from one second
to the next, so each timed expert pass is paired too: right before it (after its own flush) the
same threads read what the pass reads (its matrices' weights and scales, for each chosen expert)
from memory, and the "paired" column is the median over the repeats of the pass's GB/s over
that read's ("pair read", GB/s). A pass at paired 1.0 reads its weights as fast as a plain sum
of them does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from bench_ext import load as load_bench
from strata_stream import ExpertPack
from strata_stream.pack import Geometry, write_pack
from strata_stream.pack.presets import Preset, preset_expert, preset_router

_bench = load_bench()  # built on demand: an install has no _bench

FORMATS = ("q4", "q8", "mxfp4", "bf16")
PASSES = ("gate_up", "down", "moe_mm")


def kernel_pack(fmt: str, experts: int, pack_dir: Path) -> Path:
    """One layer of `experts` random experts at Qwen3-30B-A3B's widths in `fmt` (written once)."""
    out = pack_dir / f"cpu-kernels-{fmt}-e{experts}.strpk"
    if out.exists():
        return out
    gs = 32 if fmt == "mxfp4" else 64
    preset = Preset(
        f"cpu-kernels-{fmt}",
        Geometry(1, experts, 8, 2048, 768, "softmax_topk", True),
        fmt,
        gs,
        "e8m0" if fmt == "mxfp4" else "f16",
        "qwen3_moe",
        "the CPU kernel benchmark's layer",
    )
    print(f"writing {out} (once)")
    out.parent.mkdir(parents=True, exist_ok=True)
    return write_pack(
        out,
        preset.geometry,
        lambda layer: preset_router(preset, 0, layer),
        lambda layer, e: preset_expert(preset, 0, layer, e, fmt, gs),
        weight_format=fmt,
        group_size=gs,
        scale_dtype=preset.scale_dtype,
        architecture=preset.architecture,
        source="benchmarks/cpu_kernels.py",
        progress=False,
    )


def last_level_cache_bytes() -> int:
    """The largest cache sysfs reports for cpu0 (0 when it reports none)."""
    sizes = [0]
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="0 = every core")
    ap.add_argument(
        "--buffer-gb",
        type=float,
        default=0.0,
        help="bandwidth and cache-flush buffer (default: twice the last-level cache, >= 1 GiB)",
    )
    ap.add_argument("--pack-dir", type=Path, default=Path("packs"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if any(r < 1 for r in args.rows) or args.repeats < 1 or args.experts < 8:
        ap.error("--rows and --repeats must be >= 1, --experts >= 8")
    buf = int(args.buffer_gb * (1 << 30)) or max(1 << 30, 2 * last_level_cache_bytes())
    packs = {fmt: kernel_pack(fmt, args.experts, args.pack_dir) for fmt in args.formats}
    print(
        f"threads {args.threads or 'every core'}, buffer {buf / (1 << 30):.2f} GiB, "
        f"median of {args.repeats}"
    )
    print(
        f"{'format':>6} {'rows':>5} {'kernel':>8} {'ms':>9} {'GB/s':>7} {'read':>6} {'ratio':>6} "
        f"{'pair read':>9} {'paired':>6}"
    )
    results = []
    for fmt, path in packs.items():
        with ExpertPack.open(path) as pack:
            assert pack.weight_format == fmt
        for rows in args.rows:
            bw = _bench.bench_read_bandwidth(buf, threads=args.threads, repeats=args.repeats) / 1e9
            timings = _bench.bench_kernels(
                str(path),
                layer=0,
                rows=rows,
                repeats=args.repeats,
                threads=args.threads,
                flush_bytes=buf,
            )
            for k in timings:
                if k["op"] not in PASSES:
                    continue
                gbps = k["weight_bytes"] / k["seconds"] / 1e9
                results.append(
                    {
                        "format": fmt,
                        "rows": rows,
                        "kernel": k["op"],
                        "seconds": k["seconds"],
                        "gbps": gbps,
                        "read_gbps": bw,
                        "ratio": gbps / bw,
                        "paired_read_gbps": k["paired_read_bytes_per_s"] / 1e9,
                        "paired_ratio": k["paired_ratio"],
                    }
                )
                print(
                    f"{fmt:>6} {rows:>5} {k['op']:>8} {k['seconds'] * 1e3:>9.3f} {gbps:>7.2f} "
                    f"{bw:>6.2f} {gbps / bw:>6.2f} {k['paired_read_bytes_per_s'] / 1e9:>9.2f} "
                    f"{k['paired_ratio']:>6.2f}"
                )
    if results:
        for key, what in (("ratio", "read bandwidth"), ("paired_ratio", "the paired read")):
            ratios = [r[key] for r in results]
            print(
                f"ratio to {what}: median {statistics.median(ratios):.2f}, "
                f"min {min(ratios):.2f}, max {max(ratios):.2f}"
            )
    if args.json:
        args.json.write_text(json.dumps({"buffer_bytes": buf, "rows": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
