"""Eviction policies on routing traces: the engine's hit rate beside LRU and Belady, in one run.

    python benchmarks/cache_policies.py [--trace CSV] [--json OUT] [--plot OUT.png]

For the real Qwen3-30B-A3B trace (tests/data/, or --trace) and for routing from the
calibrated synthetic driver (the same geometry, 28 prompt + 128 decode tokens, two seeds),
replays every access through the real ExpertStream (`strata_stream.trace.replay`) at several arena
sizes with each eviction policy, and prints:

- the policy alone (no prefetch): engine hit rate per policy, plain LRU, Belady's optimum;
- with modelled next-layer predictions of recall 0.89 (the figure reported for the real model;
  the trace has no hidden states): the hit rate then counts experts prefetched one step ahead,
  and `reads/use` shows what the prefetch costs in reads. LRU and Belady never prefetch.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import require_matplotlib
from strata_stream.config import EVICTION_POLICIES
from strata_stream.trace.format import Trace, read_trace, write_strata_trace
from strata_stream.trace.replay import (
    belady_hit_rate,
    engine_hit_rate,
    lru_hit_rate,
    predicted_steps,
)

SIZES = (288, 576, 1000, 1370, 2000, 3000)
RECALL = 0.89
_TRACE = Path(__file__).resolve().parents[1] / "tests" / "data" / "qwen3-30b-a3b.route.csv"


def synthetic_trace(seed: int, directory: Path) -> Trace:
    """Routing of the synthetic driver on the Qwen3-30B-A3B geometry, as a strata_trace."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from calibrate_synthetic import N_DECODE, TOP_K, run_driver
    from strata_stream.synthetic import DriverKnobs

    routing, _ = run_driver(28, seed, DriverKnobs())
    rows = [
        (t, layer, e) for t, token in enumerate(routing) for layer, es in token.items() for e in es
    ]
    path = directory / f"synthetic-{seed}-{N_DECODE}.csv"
    return read_trace(write_strata_trace(path, 48, 128, TOP_K, rows))


def measure(name: str, trace: Trace, cache: Path) -> list[dict[str, Any]]:
    keys = trace.accesses()
    rows = []
    for slots in SIZES:
        # The offline references depend on the accesses and the size only: once per size.
        lru, belady = lru_hit_rate(keys, slots), belady_hit_rate(keys, slots)
        for recall in (None, RECALL):
            predictions = None if recall is None else predicted_steps(trace, recall)
            row: dict[str, Any] = {
                "trace": name,
                "slots": slots,
                "prediction_recall": recall,
                "lru_hit_rate": lru,
                "belady_hit_rate": belady,
            }
            for policy in EVICTION_POLICIES:
                hit_rate, reads = engine_hit_rate(trace, slots, policy, predictions, cache)
                row[policy] = hit_rate
                row[f"{policy}_reads_per_use"] = reads
            rows.append(row)
            print(
                f"{name:<14} {slots:>5} {'off' if recall is None else recall:>5}  "
                + "  ".join(f"{row[p]:.3f}" for p in EVICTION_POLICIES)
                + f"  {lru:.3f}  {belady:.3f}  "
                + "  ".join(f"{row[p + '_reads_per_use']:.3f}" for p in EVICTION_POLICIES),
                flush=True,
            )
    return rows


def plot(rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["trace"] for r in rows))
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        alone = [r for r in rows if r["trace"] == name and r["prediction_recall"] is None]
        pred = [r for r in rows if r["trace"] == name and r["prediction_recall"] is not None]
        x = [r["slots"] for r in alone]
        ax.plot(x, [r["belady_hit_rate"] for r in alone], "k--", label="Belady (offline)")
        for policy, style in zip(EVICTION_POLICIES, ("o-", "s-"), strict=True):
            ax.plot(x, [r[policy] for r in alone], style, label=f"engine {policy}")
        ax.plot(x, [r["lru_hit_rate"] for r in alone], ":", color="grey", label="plain LRU")
        ax.plot(
            x,
            [r["decayed_lfu"] for r in pred],
            "^-",
            alpha=0.6,
            label=f"decayed_lfu + prefetch (recall {RECALL})",
        )
        ax.set_title(name)
        ax.set_xlabel("arena slots (experts)")
        ax.set_ylabel("hit rate")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--trace", type=Path, default=_TRACE, help="route_trace v1 CSV")
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1], help="synthetic driver seeds")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path, help="PNG of hit rate against arena size")
    args = ap.parse_args()
    require_matplotlib(ap, args.plot)

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp)
        traces: list[tuple[str, Trace]] = []
        if args.trace.exists():
            traces.append(("qwen3 (real)", read_trace(args.trace)))
        else:
            print(f"{args.trace} not found: synthetic traces only")
        traces += [(f"synthetic s{s}", synthetic_trace(s, cache)) for s in args.seeds]
        print(
            f"{'trace':<14} {'slots':>5} {'pred':>5}  "
            + "  ".join(f"{p[:5]:>5}" for p in EVICTION_POLICIES)
            + "  lru_p  belady  reads/use per policy"
        )
        rows = [row for name, trace in traces for row in measure(name, trace, cache)]
    print(f"{time.perf_counter() - t0:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
