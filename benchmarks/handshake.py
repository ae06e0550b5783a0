"""Host time per layer of the CPU/GPU handshake (at_layer + after_layer), IO waits excluded.

    python benchmarks/handshake.py [--pack P] [--json OUT]

Decode steps of the synthetic driver on the qwen3-30b-a3b preset (an arena of 25% of the
experts, prediction on): the Window times its host work at both host points of every layer,
not counting time blocked on reads or on the device. It reports wall time and the host thread's
CPU time: on a 2-core machine the wall figure mostly measures the scheduler running IO and
device threads in between. Target: under 20 us per layer.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from common import ensure_pack
from strata_stream import ExpertPack, ExpertStream, StreamConfig, Window
from strata_stream.synthetic import SyntheticDriver


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--pack", type=Path)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--arena-fraction", type=float, default=0.25)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    path = ensure_pack(args.pack)
    with ExpertPack.open(path) as pack:
        g = pack.geometry
        n_slots = int(g.n_layers * g.n_experts * args.arena_fraction)
        config = StreamConfig.from_env(arena_bytes=n_slots * pack.record_stride, direct_io=True)
        driver = SyntheticDriver(g, pack.router_weights, seed=0)
        with ExpertStream(path, config) as stream, Window(stream) as window:
            x = driver.prompt(8)
            with window.turn():
                for layer in range(g.n_layers):
                    window.moe(layer, x.layer_input(layer))
            window.reset_stats()
            with window.turn():
                for _ in range(args.tokens):
                    t = driver.decode()
                    for layer in range(g.n_layers):
                        window.moe(layer, t.layer_input(layer))
            total = window.stats()["total"]
    calls = total["calls"]
    host_us = total["handshake_seconds"] / calls * 1e6
    host_cpu_us = total["handshake_cpu_seconds"] / calls * 1e6
    print(
        f"{calls} decode layer calls: host handshake {host_us:.1f} us per layer wall, "
        f"{host_cpu_us:.1f} us host-thread CPU (at_layer + after_layer, IO waits excluded); "
        f"stall {total['stall_seconds'] / calls * 1e6:.0f} us per layer; hit rate "
        f"{total['hit_rate']:.3f}"
    )
    if args.json:
        result = {
            "host_us_per_layer": host_us,
            "host_cpu_us_per_layer": host_cpu_us,
            "layer_calls": calls,
            "stall_us_per_layer": total["stall_seconds"] / calls * 1e6,
            "hit_rate": total["hit_rate"],
        }
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
