"""Engine read bandwidth against the raw device, measured side by side in one run.

    python benchmarks/io_bandwidth.py [--pack P | --preset qwen3-30b-a3b] [--json OUT]

Raw: fio (Debian's `fio`; a threaded O_DIRECT pread reader in this script when fio is absent)
reading the pack's records sequentially with O_DIRECT at the engine's part size and queue depth
(io_threads reads in flight): the access pattern of the engine's IO pool streaming experts.
Engine: ExpertStream with O_DIRECT streaming every expert of a region through its arena, the
next layer requested speculatively while the current one is waited for, so the queue stays full.

Neither figure is flattered by the page cache: both use O_DIRECT, and they read disjoint,
interleaved regions of the pack (raw, engine, raw, engine), so a cache below the VM favours
neither. The ratio engine / raw is what the engine leaves on the table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from common import ensure_pack, raw_read, raw_reader_name
from strata_stream import ExpertPack, ExpertStream, StreamConfig


def engine_read(path: Path, layers: range, config: StreamConfig) -> tuple[float, int, bool]:
    """Bytes per second the engine streams every expert of `layers` through its arena."""
    with ExpertStream(path, config) as stream:
        everything = np.arange(stream.n_experts)
        t0 = time.perf_counter()
        stream.request(layers.start, everything)
        for layer in layers:
            if layer + 1 < layers.stop:  # keep the IO queue full while we wait
                stream.request(layer + 1, everything, urgent=False)
            stream.wait(layer, everything)
        wall = time.perf_counter() - t0
        st = stream.stats()
        return st["bytes_read"] / wall, st["bytes_read"], stream.direct_io


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--pack", type=Path, help="pack to read (default: the preset, packed once)")
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--pack-dir", type=Path, default=Path("packs"))
    ap.add_argument("--io-threads", type=int, default=4)
    ap.add_argument("--part-bytes", type=int, default=1 << 20)
    ap.add_argument("--gb", type=float, default=0.7, help="GB read per measurement phase")
    ap.add_argument("--rounds", type=int, default=6, help="raw/engine pairs, interleaved")
    ap.add_argument("--json", type=Path, help="write raw_gbps, engine_gbps, ratio here")
    args = ap.parse_args()

    path = ensure_pack(args.pack, args.preset, args.pack_dir)
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
