"""A Window's layer call on the cuda backend against its rows: the engine's whole cost a layer.

    python benchmarks/cuda_window_rows.py [--rows 1 64 256 1024 2048] [--reps 5]
        [--experts 128] [--max-rows 1024 2048] [--json OUT]

Every expert resident (an arena that holds the pack), Qwen3-30B-A3B's widths (hidden 2048,
moe_intermediate 768, top-8) over 2 layers of bf16 experts, random routing, the predictions of
layers l+1 and l+2 given (as the transformers engine gives them). For each row count, the median
wall time a layer, torch synchronized around each turn of both layers:
- device: `moe_routed_device` on torch CUDA tensors (x read and out written in place), drained;
- queued: the same given torch's stream (every chunk returns with its kernels queued, so a
  call of several chunks runs them back to back on the GPU);
- host: `moe_routed`, x and out in host memory (uploaded and brought back);
- external: `moe_routed_external` with a compute function that does nothing, so nothing runs on
  the GPU: the handshake, the waves and the scratch alone.
Printed side by side with device / external (how much of a call the host's part is not) and
device / queued (what returning queued saves: a call's chunks back to back on the GPU), for
each --max-rows (the Window's chunk: a call of more rows runs in chunks, which drain one by
one without the caller's stream), each on a stream of its own over the same pack.
A Window's call of a 2048-row prompt took 29 ms a layer here while its scratch was zeroed at
each turn, 2.7 ms since (docs/cuda.md, Figures).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from common import QWEN3_HIDDEN, QWEN3_TOP_K, write_bf16_pack
from strata_stream import ExpertPack, ExpertStream, StreamConfig, Window

HIDDEN, TOP_K, LAYERS = QWEN3_HIDDEN, QWEN3_TOP_K, 2


def median_ms(fn: Callable[[], None], reps: int) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times) / LAYERS


def time_rows(
    window: Window, rows: int, experts: int, reps: int, rng: np.random.Generator, stream: int
) -> dict[str, float]:
    """The four calls' ms a layer at `rows` rows (random routing, bf16-valued x)."""
    dev = torch.device("cuda", 0)
    ids = np.stack([rng.choice(experts, TOP_K, replace=False) for _ in range(rows)])
    ids = ids.astype(np.int32)
    w = np.full((rows, TOP_K), 1.0 / TOP_K, np.float32)
    x = torch.randn(rows, HIDDEN, device=dev).bfloat16().float()
    y = torch.empty_like(x)
    xh = x.cpu().numpy()

    def device(on: int | None = None) -> None:
        for layer in range(LAYERS):
            window.moe_routed_device(layer, x, ids, w, y, ids, ids, stream=on)

    def host() -> None:
        for layer in range(LAYERS):
            window.moe_routed(layer, xh, ids, w, ids, ids)

    def external() -> None:
        for layer in range(LAYERS):
            window.moe_routed_external(layer, ids, lambda r0, n, s: None, ids, ids)

    for fn in (device, host, external):  # each shape's first call is not timed
        fn()
    row = {
        "rows": rows,
        "device_ms": median_ms(device, reps),
        "queued_ms": median_ms(lambda: device(stream), reps),
        "host_ms": median_ms(host, reps),
        "external_ms": median_ms(external, reps),
    }
    row["device_over_external"] = row["device_ms"] / row["external_ms"]
    return row


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256, 1024, 2048])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--max-rows", type=int, nargs="+", default=[1024])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if min(args.rows + args.max_rows + [args.reps]) < 1 or args.experts < TOP_K:
        ap.error(f"--rows, --max-rows and --reps must be positive, --experts at least {TOP_K}")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (torch.cuda.is_available() is False)")
    rng = np.random.default_rng(1)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rows.strpk"
        write_bf16_pack(path, LAYERS, args.experts)
        with ExpertPack.open(path) as pack:
            everything = pack.geometry.n_records * pack.record_stride
        for max_rows in args.max_rows:
            cfg = StreamConfig(arena_bytes=everything, max_rows=max_rows)
            with ExpertStream(path, cfg) as stream, Window(stream, backend="cuda") as window:
                stream_handle = torch.cuda.current_stream(0).cuda_stream
                for rows in args.rows:
                    row = time_rows(window, rows, args.experts, args.reps, rng, stream_handle)
                    row["max_rows"] = max_rows
                    # What returning queued saves (every chunk of a call, back to back).
                    row["device_over_queued"] = row["device_ms"] / row["queued_ms"]
                    results.append(row)
                    print(f"max_rows {max_rows}, {rows:5d} rows, ms a layer: device "
                          f"{row['device_ms']:.3f}, queued {row['queued_ms']:.3f}, host "
                          f"{row['host_ms']:.3f}, external {row['external_ms']:.3f}; device / "
                          f"external {row['device_over_external']:.1f}, device / queued "
                          f"{row['device_over_queued']:.2f}", flush=True)  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
