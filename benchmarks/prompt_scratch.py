"""What a prompt turn's scratch costs the host: a released scratch against a kept one.

    python benchmarks/prompt_scratch.py [--rows 256 1024 2048] [--reps 7] [--json OUT]

A Window sizes its scratch (x, out, expert activations h, weighted expert outputs y: about
4 * rows * top_k * (hidden + moe_intermediate) bytes) at a prompt turn's first chunk and, unless
STRATA_METAL_PROMPT_BUF_REUSE keeps it, frees it when the turn ends, so every prompt allocates
it again. Here the experts are computed by nobody (`moe_routed_external` with a compute
function that does nothing, every expert resident), so the figure is the host's own cost of a
prompt turn: the handshake, the waves and the scratch. Qwen3-30B-A3B's widths (hidden 2048,
moe_intermediate 768, top-8) with 16 experts a layer (the scratch does not depend on the expert
count), 2 layers. The two settings run interleaved, rep by rep, in one process; the ratio
released / kept is what freeing the scratch between turns costs. Before the scratch stopped
being zero-filled it was 48 / 262 / 186 at 256 / 1024 / 2048 rows (15.4 ms a layer against 0.06
at 1024 rows, on the 2-core test machine); since, 1.03-1.12 (docs/cuda.md: the same cost was
22 ms a layer of a 2048-token prompt on the H200's host).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from common import QWEN3_TOP_K, write_bf16_pack
from strata_stream import ExpertStream, StreamConfig, Window

EXPERTS, TOP_K, LAYERS = 16, QWEN3_TOP_K, 2


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rows", type=int, nargs="+", default=[256, 1024, 2048])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if any(r < 1 for r in args.rows) or args.reps < 1:
        ap.error("--rows and --reps must be positive")
    rng = np.random.default_rng(1)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "scratch.strpk"
        write_bf16_pack(path, LAYERS, EXPERTS, one_expert=True)
        windows = {}
        streams = []
        try:
            for name, keep in (("released", False), ("kept", True)):
                cfg = StreamConfig(arena_bytes=1 << 30, prompt_buf_reuse=keep)
                stream = ExpertStream(path, cfg)
                streams.append(stream)
                windows[name] = Window(stream, backend="cpu")
            for rows in args.rows:
                ids = np.stack([rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(rows)])
                ids = ids.astype(np.int32)
                ms: dict[str, list[float]] = {name: [] for name in windows}
                for rep in range(args.reps + 1):  # the first rep warms both up
                    for name, window in windows.items():
                        t0 = time.perf_counter()
                        for layer in range(LAYERS):  # one turn: it ends after the last layer
                            window.moe_routed_external(layer, ids, lambda r0, n, slots: None)
                        if rep:
                            ms[name].append(1e3 * (time.perf_counter() - t0) / LAYERS)
                row = {"rows": rows, **{f"{n}_ms": statistics.median(v) for n, v in ms.items()}}
                row["released_over_kept"] = row["released_ms"] / row["kept_ms"]
                results.append(row)
                print(f"{rows:5d} rows: released {row['released_ms']:.3f} ms a layer, kept "
                      f"{row['kept_ms']:.3f} ms, released / kept {row['released_over_kept']:.2f}",
                      flush=True)  # fmt: skip
        finally:
            for window in windows.values():
                window.close()
            for stream in streams:
                stream.close()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
