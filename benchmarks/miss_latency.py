"""What one urgent miss costs: request to wait() for a record not in the arena, from a warm page
cache (a device faster than this machine's disk, as an Apple SSD or the H200's host is), with
the record's CRC32C check (verify_reads, the default) against without it, side by side.

    python benchmarks/miss_latency.py [--formats q4 bf16] [--io-threads 4 ...] [--part-kib 1024 ...]
        [--rounds 6] [--backend cpu|cuda] [--json OUT]

Several --io-threads, --part-kib and --io-spin-us values are measured in turn, each
combination a row, so the settings that make a miss shortest can be read side by side.

The packs have Qwen3-30B-A3B's expert shape (hidden 2048, moe_intermediate 768): 2.5 MiB records
in q4 g64, 9 MiB in bf16; 2 layers x 32 experts, written once under --pack-dir. The arena holds
16 slots, so walking 32 experts misses on each (only misses are timed). Each part's CRC is taken
by the IO thread that read it, and the record's check after the last part combines them
(`crc32c_combine`); what is left of the check on a miss's path is the "verify costs" column.
--backend: a Window of that backend is open on the stream, so its record observer runs in every
miss (the CUDA backend's copy of the record to its device slot, before it is published).
A second table splits a miss (means, verification on) by the stream's miss phases: queued until
its first part began (the IO threads' wake), the reads, the CRC and the record observers, the
publication, and the rest of wait() (the waiter's wake).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import time
from pathlib import Path

from strata_stream import ExpertPack, ExpertStream, StreamConfig, Window, testing
from strata_stream.pack import Geometry, presets


def ensure(fmt: str, pack_dir: Path) -> Path:
    out = pack_dir / f"miss_latency_{fmt}.strpk"
    if not out.exists():
        pack_dir.mkdir(parents=True, exist_ok=True)
        base = presets.PRESETS["qwen3-30b-a3b"]
        g = Geometry(2, 32, 8, base.geometry.hidden, base.geometry.moe_intermediate,
                     "softmax_topk", True)  # fmt: skip
        presets.PRESETS["miss-latency"] = dataclasses.replace(
            base, name="miss-latency", geometry=g, weight_format=fmt
        )
        presets.pack_preset("miss-latency", out, progress=False)
    return out


PHASES = ("queued", "read", "finish", "publish")


def miss_ms(
    path: Path, verify: bool, io_threads: int, part: int, rounds: int, backend: str, spin_us: int,
    phases: dict[str, float] | None = None,
) -> list[float]:  # fmt: skip
    """The misses' wait() times, ms. `phases`: the stream's miss phases (stats.h) added to it,
    seconds summed over the misses, and their count under "timed"."""
    with ExpertPack.open(path) as p:
        stride, n_experts = p.record_stride, p.geometry.n_experts
    cfg = StreamConfig(arena_bytes=16 * stride, io_threads=io_threads, part_bytes=part,
                       io_spin_us=spin_us, direct_io=False, verify_reads=verify,
                       persist_profile=False)  # fmt: skip
    out: list[float] = []
    with ExpertStream(path, cfg) as s, Window(s, backend=backend):
        for r in range(rounds):
            for e in range(n_experts):
                m0 = s.stats()["misses"]
                t = time.perf_counter()
                testing.wait(s, r % 2, [e])
                dt = time.perf_counter() - t
                if s.stats()["misses"] > m0:
                    out.append(1e3 * dt)
        if phases is not None:
            st = s.stats()
            phases["timed"] = phases.get("timed", 0.0) + st["miss_timed"]
            phases["wait"] = phases.get("wait", 0.0) + sum(out) / 1e3
            phases["misses"] = phases.get("misses", 0.0) + len(out)
            for ph in PHASES:
                phases[ph] = phases.get(ph, 0.0) + st[f"miss_{ph}_seconds"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--formats", nargs="+", default=["q4", "bf16"])
    ap.add_argument("--pack-dir", type=Path, default=Path("packs"))
    ap.add_argument("--io-threads", type=int, nargs="+", default=[StreamConfig.io_threads])
    ap.add_argument("--part-kib", type=int, nargs="+", default=[StreamConfig.part_bytes >> 10],
                    help="part sizes, KiB (multiples of 4)")  # fmt: skip
    ap.add_argument("--io-spin-us", type=int, nargs="+", default=[StreamConfig.io_spin_us],
                    help="IO threads' and waits' spin before sleeping, us")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--backend", default="cpu", help="the Window whose record observer runs")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = []
    print("| format | record MiB | IO threads | part KiB | spin us | miss p50 ms, verify on "
          "| verify off | verify costs | on / off |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for fmt in args.formats:
        path = ensure(fmt, args.pack_dir)
        path.read_bytes()  # warm the page cache
        with ExpertPack.open(path) as p:
            mib = p.record_stride / 2**20
        for threads, kib, spin in itertools.product(args.io_threads, args.part_kib,
                                                    args.io_spin_us):  # fmt: skip
            on: list[float] = []
            off: list[float] = []
            phases: dict[str, float] = {}
            for _ in range(2):  # interleaved, so drift hits both alike
                on += miss_ms(path, True, threads, kib << 10, args.rounds, args.backend, spin,
                              phases)  # fmt: skip
                off += miss_ms(path, False, threads, kib << 10, args.rounds, args.backend, spin)
            a, b = statistics.median(on), statistics.median(off)
            # Means, us a miss (verification on): the stream's phases, and the rest of wait()
            # (the waiter's wake and the call itself) as the mean wait less them.
            n = max(phases["timed"], 1.0)
            split = {ph: 1e6 * phases[ph] / n for ph in PHASES}
            split["wake"] = 1e6 * phases["wait"] / max(phases["misses"], 1.0) - sum(split.values())
            rows.append({"format": fmt, "record_mib": mib, "io_threads": threads,
                         "part_kib": kib, "io_spin_us": spin, "verify_ms": a,
                         "no_verify_ms": b, "phases_us": split})  # fmt: skip
            print(f"| {fmt} | {mib:.1f} | {threads} | {kib} | {spin} | {a:.3f} | {b:.3f} | "
                  f"{a - b:.3f} | x{a / b:.2f} |", flush=True)  # fmt: skip
    print("\nwhere a miss's time went, verification on (means, us): queued until its first part "
          "began | first part to the completing part's pread end | then the CRC and the record "
          "observers (a backend's device copies) | publication | the rest of wait() (the "
          "waiter's wake)")  # fmt: skip
    print("| format | IO threads | part KiB | spin us | queued | reads | CRC, observers | publish "
          "| wake |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ph = r["phases_us"]
        print(f"| {r['format']} | {r['io_threads']} | {r['part_kib']} | {r['io_spin_us']} | "
              f"{ph['queued']:.0f} | {ph['read']:.0f} | {ph['finish']:.0f} | {ph['publish']:.0f} "
              f"| {ph['wake']:.0f} |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
