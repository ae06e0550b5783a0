"""`strata-stream demo`: a synthetic MoE model streamed through a quarter-size arena.

Packs the demo preset on first use, runs a prompt and then decode tokens through every MoE layer
with the experts streamed into an arena of 25% of them, runs the same inputs all-resident, and
checks the two outputs are bitwise identical. Prints tokens/s, hit rate, bytes read, stall time
and next-layer prediction recall; exits non-zero if parity fails.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from tqdm import tqdm

from strata_stream.config import StreamConfig
from strata_stream.pack import ExpertPack, pack_preset
from strata_stream.paths import cache_dir
from strata_stream.stream import ExpertStream
from strata_stream.synthetic import SyntheticDriver
from strata_stream.window import Window


@dataclass
class RunResult:
    outputs: list[npt.NDArray[np.float32]]
    prompt_seconds: float
    decode_seconds: float
    window: dict[str, Any]
    stream: dict[str, Any]


def run(
    path: Path,
    pack: ExpertPack,
    config: StreamConfig,
    prompt: int,
    decode: int,
    seed: int,
    label: str,
) -> RunResult:
    g = pack.geometry
    driver = SyntheticDriver(g, pack.router_weights, seed=seed)
    outputs: list[npt.NDArray[np.float32]] = []
    with ExpertStream(path, config) as stream, Window(stream) as window:
        bar = tqdm(total=prompt + decode, unit="tok", desc=label, leave=False)
        t0 = time.perf_counter()
        tokens = driver.prompt(prompt)
        with window.turn():
            for layer in range(g.n_layers):
                outputs.append(window.moe(layer, tokens.layer_input(layer)))
        bar.update(prompt)
        t1 = time.perf_counter()
        with window.turn():  # one conversation turn: the decode steps follow the prompt
            for _ in range(decode):
                tokens = driver.decode()
                for layer in range(g.n_layers):
                    outputs.append(window.moe(layer, tokens.layer_input(layer)))
                bar.update(1)
        t2 = time.perf_counter()
        bar.close()
        return RunResult(outputs, t1 - t0, t2 - t1, window.stats(), stream.stats())


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
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens (default 256)")
    p.add_argument("--decode", type=int, default=64, help="decode tokens (default 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--io-threads", type=int, default=StreamConfig.io_threads)
    p.add_argument("--buffered", action="store_true", help="no O_DIRECT")
    args = p.parse_args(list(argv))
    if not 0 < args.arena_fraction <= 1:
        p.error("--arena-fraction must be in (0, 1]")
    if args.prompt < 1 or args.decode < 0:
        p.error("--prompt must be >= 1 and --decode >= 0")
    return args


def main(argv: Sequence[str] = ()) -> int:
    args = _parse(argv)
    path: Path = args.pack or cache_dir() / f"{args.preset}.strpk"
    if not path.exists():
        print(f"packing the {args.preset!r} preset into {path} (first run only)")
        path.parent.mkdir(parents=True, exist_ok=True)
        pack_preset(args.preset, path)
    with ExpertPack.open(path) as pack:
        g = pack.geometry
        stride = pack.record_stride
        n_all = g.n_layers * g.n_experts
        n_slots = max(2 * g.top_k, int(n_all * args.arena_fraction))
        base = StreamConfig.from_env(io_threads=args.io_threads, direct_io=not args.buffered)
        print(
            f"{path.name}: {g.n_layers} layers x {g.n_experts} experts (top-{g.top_k}), "
            f"{pack.weight_format}, {stride / 2**20:.2f} MiB per expert; arena {n_slots} slots "
            f"({n_slots * stride / 2**20:.0f} MiB, {n_slots / n_all:.0%} of the experts)"
        )
        streamed = run(
            path,
            pack,
            base.replace(arena_bytes=n_slots * stride),
            args.prompt,
            args.decode,
            args.seed,
            "streamed",
        )
        resident = run(
            path,
            pack,
            base.replace(arena_bytes=n_all * stride, lookahead=False),
            args.prompt,
            args.decode,
            args.seed,
            "all-resident",
        )

    same = all(
        np.array_equal(a, b) for a, b in zip(streamed.outputs, resident.outputs, strict=True)
    )
    total = streamed.window["total"]
    st = streamed.stream
    print(
        f"prompt: {args.prompt} tokens in {streamed.prompt_seconds:.2f} s "
        f"({args.prompt / streamed.prompt_seconds:.1f} tok/s; all-resident "
        f"{args.prompt / resident.prompt_seconds:.1f} tok/s)"
    )
    if args.decode:
        print(
            f"decode: {args.decode} tokens in {streamed.decode_seconds:.2f} s "
            f"({args.decode / streamed.decode_seconds:.1f} tok/s; all-resident "
            f"{args.decode / resident.decode_seconds:.1f} tok/s)"
        )
    recall = total["recall"]
    print(
        f"hit rate {total['hit_rate']:.3f}, bytes read {st['bytes_read'] / 1e9:.2f} GB "
        f"({'O_DIRECT' if st['direct_io'] else 'buffered'}), stall "
        f"{total['stall_seconds']:.2f} s, next-layer prediction recall "
        f"{recall if recall is None else round(recall, 3)}"
    )
    if not same:
        print("FAILED: streamed output differs from the all-resident run", file=sys.stderr)
        return 1
    print("parity: streamed output is bitwise identical to the all-resident run")
    return 0
