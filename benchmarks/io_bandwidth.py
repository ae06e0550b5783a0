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
import mmap
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from strata_stream import ExpertPack, ExpertStream, StreamConfig
from strata_stream.pack import pack_preset


def fio_read(path: Path, offset: int, size: int, part: int, depth: int) -> float:
    """Bytes per second fio reads [offset, offset + size) with O_DIRECT, `depth` in flight."""
    cmd = [
        "fio",
        "--name=raw",
        f"--filename={path}",
        "--rw=read",
        "--direct=1",
        "--ioengine=libaio",
        f"--iodepth={depth}",
        f"--bs={part}",
        f"--offset={offset}",
        f"--size={size // part * part}",
        "--output-format=json",
        "--readonly",
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    report = json.loads(out[out.index("{") :])
    return float(report["jobs"][0]["read"]["bw_bytes"])


def threaded_read(path: Path, offset: int, size: int, part: int, depth: int) -> float:
    """The fallback raw reader: `depth` threads taking consecutive parts, O_DIRECT preads."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    n_parts = size // part
    done = [0] * depth

    def run(j: int) -> None:
        buf = mmap.mmap(-1, part)  # page-aligned, as O_DIRECT requires
        for i in range(j, n_parts, depth):
            done[j] += os.preadv(fd, [buf], offset + i * part)

    threads = [threading.Thread(target=run, args=(j,)) for j in range(depth)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    os.close(fd)
    return sum(done) / wall


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

    path = args.pack or args.pack_dir / f"{args.preset}.strpk"
    if not path.exists():
        print(f"packing {args.preset} into {path} (once)")
        path.parent.mkdir(parents=True, exist_ok=True)
        pack_preset(args.preset, path)
    with ExpertPack.open(path) as pack:
        g = pack.geometry
        stride = pack.record_stride
        records = pack.records_offset
    layer_bytes = g.n_experts * stride
    layers_per_phase = max(
        1, min(g.n_layers // (2 * args.rounds), int(args.gb * 1e9 // layer_bytes))
    )
    use_fio = shutil.which("fio") is not None
    raw_reader = fio_read if use_fio else threaded_read
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
        f"{'fio' if use_fio else 'threaded O_DIRECT preads'}"
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
            return raw_reader(
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
        "raw_reader": "fio" if use_fio else "threads",
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
