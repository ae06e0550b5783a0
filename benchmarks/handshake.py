"""Host time per layer of the CPU/GPU handshake (at_layer + after_layer), IO waits excluded.

    python benchmarks/handshake.py [--pack P | --preset NAME] [--path engine|external]
                                   [--json OUT]

Decode steps of the synthetic driver on the qwen3-30b-a3b preset (an arena of 25% of the
experts, prediction on): the Window times its host work at both host points of every layer,
not counting time blocked on reads or on the device. It reports wall time and the host thread's
CPU time: on a 2-core machine the wall figure mostly measures the scheduler running IO and
device threads in between. Target: under 20 us per layer.

--path external drives the same tokens through `moe_routed_external` (the caller computes the
experts, as the MLX-kernel path does) with the routing computed here from the pack's routers and
a compute function that does nothing, and also reports the wall time of the whole layer call:
what the handshake costs a caller that runs nothing on the Window's device.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import numpy.typing as npt

from common import ensure_pack
from strata_stream import ExpertPack, ExpertStream, StreamConfig, Window
from strata_stream.synthetic import SyntheticDriver, route_ids


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--pack", type=Path)
    ap.add_argument("--preset", default="qwen3-30b-a3b", help="synthetic preset (without --pack)")
    ap.add_argument("--path", choices=("engine", "external"), default="engine")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--arena-fraction", type=float, default=0.25)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    path = ensure_pack(args.pack, args.preset)
    call_ns: list[int] = []
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
            routers = [pack.router_weights(layer) for layer in range(g.n_layers)]

            def nothing(row0: int, rows: int, slots: npt.NDArray[np.uint32]) -> None:
                pass

            with window.turn():
                for _ in range(args.tokens):
                    t = driver.decode()
                    for layer in range(g.n_layers):
                        x = t.layer_input(layer)
                        if args.path == "engine":
                            window.moe(layer, x)
                            continue
                        ids = route_ids(x, routers[layer], g.top_k)
                        nxt = layer + 1
                        pred1 = route_ids(x, routers[nxt], g.top_k) if nxt < g.n_layers else None
                        t0 = time.perf_counter_ns()
                        window.moe_routed_external(layer, ids, nothing, pred1=pred1)
                        call_ns.append(time.perf_counter_ns() - t0)
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
    if call_ns:
        print(
            f"external path: whole layer call {np.median(call_ns) / 1e3:.1f} us median, "
            f"{np.mean(call_ns) / 1e3:.1f} us mean over {len(call_ns)} calls"
        )
    if args.json:
        result = {
            "host_us_per_layer": host_us,
            "host_cpu_us_per_layer": host_cpu_us,
            "layer_calls": calls,
            "stall_us_per_layer": total["stall_seconds"] / calls * 1e6,
            "hit_rate": total["hit_rate"],
            "path": args.path,
        }
        if call_ns:
            result["call_us_median"] = float(np.median(call_ns)) / 1e3
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
