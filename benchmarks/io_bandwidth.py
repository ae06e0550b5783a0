"""Engine read bandwidth against the raw device, measured side by side in one run.

    python benchmarks/io_bandwidth.py [--pack P | --preset qwen3-30b-a3b] [--json OUT]
    python benchmarks/io_bandwidth.py --page-cache [--threads 1 2 4 8] [--parts-mib 1 4]

Raw: fio (Debian's `fio`; a threaded O_DIRECT pread reader in this script when fio is absent)
reading the pack's records sequentially with O_DIRECT at the engine's part size and queue depth
(io_threads reads in flight): the access pattern of the engine's IO pool streaming experts.
Engine: ExpertStream with O_DIRECT streaming every expert of a region through its arena, the
next layer requested speculatively while the current one is waited for, so the queue stays full.

Neither figure is flattered by the page cache: both use O_DIRECT, and they read disjoint,
interleaved regions of the pack (raw, engine, raw, engine), so a cache below the VM favours
neither. The ratio engine / raw is what the engine leaves on the table.

--page-cache: a device faster than this machine's disk (an Apple SSD reads 7-17 GB/s) stood in
for by a warm page cache. One region of the pack is read once to warm it, then engine and raw
read that same region with buffered preads, alternating which goes first, --rounds pairs per
(threads, part size). The raw reference is C++ (`_bench.bench_raw_read`, no GIL): the same
records split into the same parts, `threads` threads taking the next part from a shared counter,
into a pre-faulted destination as large as the engine's arena, as the engine's slots are. It
prints engine_gbps, raw_gbps and ratio (median of the per-pair ratios, with their spread).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from common import ensure_pack, raw_read, raw_reader_name
from strata_stream import ExpertPack, ExpertStream, StreamConfig, testing


def engine_read(path: Path, layers: range, config: StreamConfig) -> tuple[float, int, bool]:
    """Bytes per second the engine streams every expert of `layers` through its arena."""
    with ExpertStream(path, config) as stream:
        everything = np.arange(stream.n_experts)
        t0 = time.perf_counter()
        testing.request(stream, layers.start, everything)
        for layer in layers:
            if layer + 1 < layers.stop:  # keep the IO queue full while we wait
                testing.request(stream, layer + 1, everything, urgent=False)
            testing.wait(stream, layer, everything)
        wall = time.perf_counter() - t0
        st = stream.stats()
        return st["bytes_read"] / wall, st["bytes_read"], stream.direct_io


def page_cache(args: argparse.Namespace, path: Path) -> int:
    from bench_ext import load as load_bench

    _bench = load_bench()  # built on demand: an install has no _bench

    with ExpertPack.open(path) as pack:
        g = pack.geometry
        stride = pack.record_stride
    layer_bytes = g.n_experts * stride
    layers = range(0, max(1, min(g.n_layers - 1, int(args.gb * 1e9 // layer_bytes))))
    arena = 3 * layer_bytes
    first, count = 0, len(layers) * g.n_experts
    # Warm the region (twice: the second pass finds it cached unless memory is short).
    for _ in range(2):
        _bench.bench_raw_read(str(path), first, count, 4 << 20, 2, arena, False)
    print(
        f"{path}: page cache, {len(layers)} layers ({count * stride / 1e9:.2f} GB) per "
        f"measurement, arena {arena / 1e9:.2f} GB, {args.rounds} interleaved pairs"
    )
    rows = []
    for part_mib in args.parts_mib:
        for threads in args.threads:
            config = StreamConfig.from_env(
                arena_bytes=arena,
                io_threads=threads,
                part_bytes=part_mib << 20,
                direct_io=False,
                verify_reads=False,
            )
            eng, raw = [], []
            for r in range(args.rounds):
                for engine_first in (True, False) if r % 2 == 0 else (False, True):
                    if engine_first:
                        eng.append(engine_read(path, layers, config)[0])
                    else:
                        res = _bench.bench_raw_read(
                            str(path), first, count, part_mib << 20, threads, arena, False
                        )
                        raw.append(res["bytes"] / res["seconds"])
            ratios = [e / r for e, r in zip(eng, raw, strict=True)]
            row = {
                "io_threads": threads,
                "part_mib": part_mib,
                "engine_gbps": float(np.median(eng)) / 1e9,
                "raw_gbps": float(np.median(raw)) / 1e9,
                "ratio": float(np.median(ratios)),
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
                "engine_gbps_all": [e / 1e9 for e in eng],
                "raw_gbps_all": [x / 1e9 for x in raw],
            }
            rows.append(row)
            print(
                f"threads {threads} part {part_mib} MiB: engine {row['engine_gbps']:.2f} GB/s, "
                f"raw {row['raw_gbps']:.2f} GB/s, ratio {row['ratio']:.3f} "
                f"(pairs {row['ratio_min']:.3f}-{row['ratio_max']:.3f})",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps({"page_cache": rows, "pack": str(path)}, indent=2) + "\n")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--pack", type=Path, help="pack to read (default: the preset, packed once)")
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--pack-dir", type=Path, default=Path("packs"))
    ap.add_argument("--io-threads", type=int, default=StreamConfig.io_threads)
    ap.add_argument("--part-bytes", type=int, default=StreamConfig.part_bytes)
    ap.add_argument("--gb", type=float, default=0.7, help="GB read per measurement phase")
    ap.add_argument("--rounds", type=int, default=6, help="raw/engine pairs, interleaved")
    ap.add_argument("--json", type=Path, help="write raw_gbps, engine_gbps, ratio here")
    ap.add_argument("--page-cache", action="store_true", help="warm page cache as the device")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--parts-mib", type=int, nargs="+", default=[1, 4])
    args = ap.parse_args()

    path = ensure_pack(args.pack, args.preset, args.pack_dir)
    if args.page_cache:
        return page_cache(args, path)
    with ExpertPack.open(path) as pack:
        g = pack.geometry
        stride = pack.record_stride
        records = pack.records_offset
    layer_bytes = g.n_experts * stride
    layers_per_phase = max(
        1, min(g.n_layers // (2 * args.rounds), int(args.gb * 1e9 // layer_bytes))
    )
    config = StreamConfig.from_env(
        arena_bytes=3 * layer_bytes,
        io_threads=args.io_threads,
        part_bytes=args.part_bytes,
        direct_io=True,
    )
    print(
        f"{path}: {g.n_layers} layers x {g.n_experts} experts, stride {stride:,} B; "
        f"{layers_per_phase} layers ({layers_per_phase * layer_bytes / 1e9:.2f} GB) per phase, "
        f"part {args.part_bytes:,} B, {args.io_threads} threads, raw reader "
        f"{raw_reader_name()}"
    )

    raw_bps, engine_bps = [], []
    direct = True
    for r in range(args.rounds):
        # Alternate which reader goes first: a cloud disk's bursts and throttles then fall on
        # both alike.
        first = 2 * r * layers_per_phase
        a = range(first, first + layers_per_phase)
        b = range(first + layers_per_phase, first + 2 * layers_per_phase)
        raw_layers, eng_layers = (a, b) if r % 2 == 0 else (b, a)

        def raw_phase(layers: range = raw_layers) -> float:
            return raw_read(
                path,
                records + layers.start * layer_bytes,
                layers_per_phase * layer_bytes,
                args.part_bytes,
                args.io_threads,
            )

        if r % 2 == 0:
            raw_bps.append(raw_phase())
            bps, _, direct = engine_read(path, eng_layers, config)
        else:
            bps, _, direct = engine_read(path, eng_layers, config)
            raw_bps.append(raw_phase())
        engine_bps.append(bps)
        print(
            f"round {r}: raw {raw_bps[-1] / 1e9:.3f} GB/s (layers {raw_layers.start}-"
            f"{raw_layers.stop - 1}), engine {engine_bps[-1] / 1e9:.3f} GB/s "
            f"(layers {eng_layers.start}-{eng_layers.stop - 1}), "
            f"ratio {engine_bps[-1] / raw_bps[-1]:.3f}"
        )
    raw = float(np.mean(raw_bps)) / 1e9
    eng = float(np.mean(engine_bps)) / 1e9
    round_ratios = [e / r for e, r in zip(engine_bps, raw_bps, strict=True)]
    result = {
        "raw_gbps": raw,
        "engine_gbps": eng,
        "ratio": eng / raw,
        "raw_reader": raw_reader_name(),
        "engine_direct_io": direct,
        "part_bytes": args.part_bytes,
        "io_threads": args.io_threads,
        "bytes_per_phase": layers_per_phase * layer_bytes,
        "rounds": args.rounds,
        "pack": str(path),
    }
    print(
        f"raw {raw:.3f} GB/s, engine {eng:.3f} GB/s, ratio {eng / raw:.3f} "
        f"(median of rounds {np.median(round_ratios):.3f})"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
