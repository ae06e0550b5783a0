"""Engine read bandwidth against a raw F_NOCACHE reader on macOS (O_DIRECT on Linux), in one run.

    python benchmarks/apple/io_nocache.py [--pack P] [--json OUT]

Raw: --io-threads threads reading consecutive --part-bytes parts with pread on a descriptor
with F_NOCACHE (macOS) or O_DIRECT (Linux), so the page cache flatters neither side. Engine:
benchmarks/io_bandwidth.py's engine_read (ExpertStream, direct_io, every expert of successive
layers with the next layer requested speculatively). The two alternate over
disjoint regions of the pack, --rounds pairs; medians with min and max are reported.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import mmap
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import ensure_pack  # noqa: E402
from io_bandwidth import engine_read  # noqa: E402  (the engine side, as benchmarks/ measures it)
from strata_stream import ExpertPack, StreamConfig  # noqa: E402


def open_uncached(path: Path) -> int:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    if hasattr(fcntl, "F_NOCACHE"):
        fcntl.fcntl(fd, fcntl.F_NOCACHE, 1)
    return fd


def raw_read(path: Path, offset: int, size: int, part: int, threads: int) -> float:
    fd = open_uncached(path)
    next_part = [0]
    lock = threading.Lock()
    n_parts = size // part

    def worker() -> None:
        buf = mmap.mmap(-1, part)
        while True:
            with lock:
                i = next_part[0]
                next_part[0] += 1
            if i >= n_parts:
                return
            os.preadv(fd, [buf], offset + i * part)

    t0 = time.perf_counter()
    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    os.close(fd)
    return n_parts * part / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pack", type=Path)
    ap.add_argument("--io-threads", type=int, default=4)
    ap.add_argument("--part-bytes", type=int, default=1 << 20)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    path = ensure_pack(args.pack)
    raw, engine = [], []
    with ExpertPack.open(path) as pack:
        layer_bytes = pack.geometry.n_experts * pack.record_stride
        per_round = max(1, pack.geometry.n_layers // (2 * args.rounds))
        for r in range(args.rounds):
            first = 2 * r * per_round
            raw.append(
                raw_read(
                    path,
                    pack.records_offset + first * layer_bytes,
                    per_round * layer_bytes,
                    args.part_bytes,
                    args.io_threads,
                )
            )
            config = StreamConfig(
                arena_bytes=4 * layer_bytes,
                io_threads=args.io_threads,
                part_bytes=args.part_bytes,
                direct_io=True,
            )
            layers = range(first + per_round, first + 2 * per_round)
            engine.append(engine_read(path, layers, config)[0])
    out = {
        "raw_reader": "F_NOCACHE pread" if hasattr(fcntl, "F_NOCACHE") else "O_DIRECT pread",
        "raw_gb_per_s": [x / 1e9 for x in raw],
        "engine_gb_per_s": [x / 1e9 for x in engine],
        "ratio_median": statistics.median(e / r for e, r in zip(engine, raw, strict=True)),
    }
    print(
        f"raw {statistics.median(raw) / 1e9:.2f} GB/s ({out['raw_reader']}), engine "
        f"{statistics.median(engine) / 1e9:.2f} GB/s, ratio {out['ratio_median']:.2f}"
    )
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
