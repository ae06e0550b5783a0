"""Shared pieces of the benchmarks: the preset pack they run on, and the raw device reader."""

from __future__ import annotations

import argparse
import importlib.util
import json
import mmap
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from strata_stream.pack import Geometry, pack_preset, write_pack


def require_matplotlib(ap: argparse.ArgumentParser, plot: Path | None) -> None:
    """--plot needs matplotlib: a one-line error before the run, not a traceback after it."""
    if plot is not None and importlib.util.find_spec("matplotlib") is None:
        ap.error("--plot needs matplotlib: pip install '.[plot]'")


def ensure_pack(
    path: Path | None, preset: str = "qwen3-30b-a3b", pack_dir: Path = Path("packs")
) -> Path:
    """The pack to measure: `path`, or the preset packed once into pack_dir."""
    out = path or pack_dir / f"{preset}.strpk"
    if not out.exists():
        print(f"packing {preset} into {out} (once)")
        out.parent.mkdir(parents=True, exist_ok=True)
        pack_preset(preset, out)
    return out


# Qwen3-30B-A3B's expert widths, which the host-cost benchmarks time.
QWEN3_HIDDEN, QWEN3_INTER, QWEN3_TOP_K = 2048, 768, 8


def write_bf16_pack(path: Path, layers: int, experts: int, *, one_expert: bool = False) -> None:
    """A bf16 pack of random experts at Qwen3-30B-A3B's widths (softmax top-k routers). With
    one_expert every record holds the same matrices: quick to write where only the shapes
    matter."""
    g = Geometry(layers, experts, QWEN3_TOP_K, QWEN3_HIDDEN, QWEN3_INTER, "softmax_topk", True)
    rng = np.random.default_rng(0)
    routers = [rng.standard_normal((experts, QWEN3_HIDDEN)).astype(np.float32)] * layers
    shapes = ((QWEN3_INTER, QWEN3_HIDDEN), (QWEN3_INTER, QWEN3_HIDDEN), (QWEN3_HIDDEN, QWEN3_INTER))

    def draw() -> tuple[np.ndarray, ...]:
        return tuple(rng.standard_normal(s).astype(np.float32) / 8 for s in shapes)

    same = draw() if one_expert else None

    def expert(layer: int, e: int) -> tuple[np.ndarray, ...]:
        return draw() if same is None else same

    write_pack(path, g, routers, expert, weight_format="bf16", progress=False)


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


def raw_reader_name() -> str:
    return "fio" if shutil.which("fio") else "threaded O_DIRECT preads"


def raw_read(path: Path, offset: int, size: int, part: int, depth: int) -> float:
    """Raw device bandwidth (bytes/s), with fio when installed."""
    reader = fio_read if shutil.which("fio") else threaded_read
    return reader(path, offset, size, part, depth)


class PieceTimes:
    """Host seconds (and calls) per named piece of a loop, summed while `on`: `wrap(name, f)`
    times each call of f. One thread writes them (the loop being measured)."""

    def __init__(self) -> None:
        from collections import defaultdict

        self.total: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.on = False

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*a: Any, **k: Any) -> Any:
            if not self.on:
                return fn(*a, **k)
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.total[name] += time.perf_counter() - t0
                self.calls[name] += 1

        return timed


def stream_gaps(
    client: Any,
    model: str,
    i: int,
    max_tokens: int,
    decoding: Any,
    gaps: list[tuple[float, float]],
    stop: Any = None,
) -> None:
    """Client `i`'s streamed chat completion, the time of each content token and its gap from
    the previous chunk appended to `gaps`; from the fourth chunk on it waits for `decoding` (an
    Event), and ends early when `stop(now)` says so. For the serve benchmarks that measure how
    long a running stream stalls while another client's request is handled."""
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": f"hello world {i}"}],
        max_tokens=max_tokens, temperature=0, stream=True,
    )  # fmt: skip
    last = None
    for n, c in enumerate(stream):
        now = time.perf_counter()
        if n == 3:
            decoding.wait()
        if last is not None and c.choices and c.choices[0].delta.content:
            gaps.append((now, now - last))
        last = now
        if stop is not None and stop(now):
            break
    stream.close()
