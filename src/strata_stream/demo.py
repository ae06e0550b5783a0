"""`strata-stream demo`: pack a synthetic model and stream every expert through a small arena.

The demo is the first thing a new user runs, so it checks what it shows: every expert that
lands in the arena is compared byte for byte with the pack file before it counts.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tqdm import tqdm

from strata_stream.config import StreamConfig
from strata_stream.pack import ExpertPack, pack_preset
from strata_stream.stream import ExpertStream


def default_pack_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "strata-stream"


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="strata-stream demo", description=__doc__)
    p.add_argument(
        "--pack",
        type=Path,
        default=None,
        help="pack to stream (default: the demo preset, packed on first use)",
    )
    p.add_argument("--preset", default="demo", help="preset packed when --pack is absent")
    p.add_argument(
        "--arena-fraction",
        type=float,
        default=0.25,
        help="arena size as a fraction of all experts (default 0.25)",
    )
    p.add_argument("--io-threads", type=int, default=4)
    p.add_argument("--buffered", action="store_true", help="no O_DIRECT")
    args = p.parse_args(list(argv))
    if not 0 < args.arena_fraction <= 1:
        p.error("--arena-fraction must be in (0, 1]")
    return args


def main(argv: Sequence[str] = ()) -> int:
    args = _parse(argv)
    path: Path = args.pack or default_pack_dir() / f"{args.preset}.strpk"
    if not path.exists():
        print(f"packing the {args.preset!r} preset into {path} (first run only)")
        path.parent.mkdir(parents=True, exist_ok=True)
        pack_preset(args.preset, path)
    with ExpertPack.open(path) as pack:
        g = pack.geometry
        stride = pack.record_stride
    n_slots = max(2 * g.top_k, int(g.n_layers * g.n_experts * args.arena_fraction))
    config = StreamConfig.from_env(
        arena_bytes=n_slots * stride, io_threads=args.io_threads, direct_io=not args.buffered
    )
    print(
        f"{path.name}: {g.n_layers} layers x {g.n_experts} experts, record {stride:,} bytes; "
        f"arena {n_slots} slots ({n_slots * stride / 2**20:.0f} MiB, "
        f"{args.arena_fraction:.0%} of the experts)"
    )
    mismatches = 0
    with ExpertStream(path, config) as stream, ExpertPack.open(path) as pack:
        batch = max(1, min(g.n_experts, stream.n_slots // 2))
        t0 = time.perf_counter()
        bar = tqdm(total=g.n_layers * g.n_experts, unit="expert", desc="streaming")
        for layer in range(g.n_layers):
            for start in range(0, g.n_experts, batch):
                experts = np.arange(start, min(start + batch, g.n_experts))
                stream.wait(layer, experts)
                for e in experts:
                    got = stream.expert_bytes(layer, int(e))
                    if got is None or got.tobytes() != pack.read_record(layer, int(e)):
                        mismatches += 1
                bar.update(len(experts))
        bar.close()
        wall = time.perf_counter() - t0
        st = stream.stats()
    gb = st["bytes_read"] / 1e9
    print(
        f"read {gb:.2f} GB in {wall:.2f} s: {gb / wall:.2f} GB/s "
        f"({'O_DIRECT' if st['direct_io'] else 'buffered'}; {stream.direct_note or 'ok'})"
    )
    print(
        f"hits {st['hits']}, misses {st['misses']}, evicted {st['evicted']}, "
        f"stall {st['stall_seconds']:.2f} s"
    )
    if mismatches:
        print(f"FAILED: {mismatches} experts differ from the pack", file=sys.stderr)
        return 1
    print("every expert matched the pack byte for byte")
    return 0
