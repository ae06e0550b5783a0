"""How many distinct experts a decode batch of B sequences needs per layer, on real routing.

A decode step of B sequences is one externally routed call of B rows; the Window keeps it on
the decode path (one submission, the resident pass computed while the misses are read) while
the union of the rows' experts fits one decode submission (`wave_capacity()`: the arena's slots
less one top-k kept for the next layer's prefetches), and runs prompt waves beyond. This reads
the real Qwen3-30B-A3B trace (tests/data, 48 layers x 128 experts, top-6), takes B decode
tokens at a time as the rows of one batch (tokens of one conversation: B different sequences
overlap less, so this is the optimistic end), and reports per batch size the union per layer
(median and max over layers and batches), its ratio to B * top_k, and the smallest arena (in
expert slots) that keeps every such call on the decode path.

    python benchmarks/batch_union.py [--trace PATH] [--batches 1,2,4,8,16,32]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from strata_stream.trace.format import read_trace

DEFAULT_TRACE = Path(__file__).resolve().parents[1] / "tests" / "data" / "qwen3-30b-a3b.route.csv"


def decode_tokens(path: Path) -> tuple[list[list[tuple[int, ...]]], int, int]:
    """The trace's tokens as [token][layer] -> experts (every full pass over the layers)."""
    trace = read_trace(path)
    tokens: list[list[tuple[int, ...]]] = []
    current: list[tuple[int, ...]] = []
    for layer, experts in trace.steps:
        if layer == 0 and current:
            tokens.append(current)
            current = []
        current.append(experts)
    if len(current) == trace.n_layers:
        tokens.append(current)
    return [t for t in tokens if len(t) == trace.n_layers], trace.top_k, trace.n_experts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--batches", default="1,2,4,8,16,32")
    ap.add_argument("--decode-tokens", type=int, default=128,
                    help="the trace's last N tokens are its decode steps")  # fmt: skip
    args = ap.parse_args()
    tokens, k, n_experts = decode_tokens(args.trace)
    tokens = tokens[-args.decode_tokens :]
    print(f"{len(tokens)} decode tokens, top-{k} of {n_experts} experts, {len(tokens[0])} layers")
    print("B | union/layer median | max | union / (B*k) | arena slots for the decode path")
    for b in (int(s) for s in args.batches.split(",")):
        unions = [
            len({e for t in tokens[i : i + b] for e in t[layer]})
            for i in range(0, len(tokens) - b + 1, b)
            for layer in range(len(tokens[0]))
        ]
        u = np.array(unions)
        med, mx = float(np.median(u)), int(u.max())
        # wave_capacity() = n_slots - top_k with one Window: the decode path needs union <= it.
        print(f"{b} | {med:.0f} | {mx} | {med / (b * k):.2f} | {mx + k}")


if __name__ == "__main__":
    main()
