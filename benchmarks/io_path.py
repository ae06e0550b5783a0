"""The IO path's own throughput, beside its references and the prompt-shaped figure, in one run.

    python benchmarks/io_path.py [--pack P] [--backend cpu|cuda] [--io-threads 4 8]
        [--part-kib 256] [--rounds 3] [--prompt-rows 256] [--io-reference BIN] [--json OUT]

Every figure reads the same records of one pack (by default the 4-layer qwen3-30b-a3b-like q4
pack of benchmarks/cuda.py --decode, written once under --pack-dir) from a warm page cache, with
the same IO threads and parts, so their ratios say what each step of the engine's path costs:

- raw, staging: the records' parts pread by the same threads into two part-sized buffers a
  thread (small, reused, warm in the cache: the staging of the native CUDA reference);
- raw, arena: the same preads, each part to its place in a pre-faulted destination as large as
  the engine's arena (what the IO threads write);
- "+ crc": each part's CRC32C after its pread, by the thread that read it (verify_reads);
- cuda (with --io-reference, the binary of benchmarks/native/cuda_io_reference.cu): the native
  reference of issue 17 (pread into pinned staging, then cudaMemcpyAsync to the device, the
  copies overlapping the next preads), the same with each part pread into its place in an
  arena-sized pinned buffer (--arena), and pinned host-to-device bandwidth alone;
- engine, bulk: ExpertStream (with a Window of --backend registered, so its record observer runs:
  the CUDA backend's device copy) reading every record of the pack through its IO path into its
  slot: every layer requested urgently at once, then waited for until published; verify_reads on
  and off. Beside it, where the IO threads' time went (the stream's counters): pread, CRC32C,
  record observers, the rest of each part job (locks, bookkeeping, wakes) and idle;
- engine, prompt (--prompt-rows, 0 skips it): benchmarks/cuda.py's figure, a prompt over every
  layer on a fresh stream, its wall time less the same prompt replayed with every expert in
  place. A layer's urgent reads start only at its host point, so this counts IO in the
  prompt's shape, serialized with compute where the prediction did not hide it: it is not the
  IO path's throughput, and is reported beside it, not instead of it.

Measurements are interleaved round by round (the machine's load drifts); each figure is the
median of its --rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench_ext import load as load_bench
from strata_stream import ExpertPack, ExpertStream, StreamConfig, Window, testing

_bench = load_bench()  # built on demand: an install has no _bench

sys.path.insert(0, str(Path(__file__).parent))
from cuda import engine_to_device, make_pack  # noqa: E402  (benchmarks/cuda.py)


def raw(path: Path, count: int, part: int, threads: int, dest: int, crc: bool) -> float:
    """GB/s of plain threaded preads of the first `count` records into `dest` bytes (0: two
    part-sized buffers a thread), each part's CRC32C with `crc`."""
    r = _bench.bench_raw_read(str(path), 0, count, part, threads, dest, False, crc)
    return float(r["bytes"]) / float(r["seconds"]) / 1e9


def native(binary: Path, path: Path, offset: int, size: int, part: int, threads: int,
           arena: bool) -> dict[str, Any]:  # fmt: skip
    cmd = [str(binary), str(path), str(offset), str(size), str(part), str(threads), "2"]
    run = subprocess.run(cmd + (["--arena"] if arena else []), capture_output=True, text=True,
                         timeout=300, check=True)  # fmt: skip
    out: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    return out


def engine_bulk(path: Path, cfg: StreamConfig, backend: str) -> dict[str, float]:
    """GB/s of the engine reading every record of the pack into its slot (all urgent at once,
    waited for until published), and the IO threads' time split by the stream's counters."""
    with ExpertPack.open(path) as p:
        layers, experts = p.geometry.n_layers, p.geometry.n_experts
    with ExpertStream(path, cfg) as stream, Window(stream, backend=backend):
        every = np.arange(experts)
        t0 = time.perf_counter()
        for layer in range(layers):
            testing.request(stream, layer, every)
        for layer in range(layers):
            testing.wait(stream, layer, every)
        wall = time.perf_counter() - t0
        st = stream.stats()
    thread_s = cfg.io_threads * wall
    read, crc, obs = st["read_seconds"], st["crc_seconds"], st["observer_seconds"]
    job, cpu = st["io_job_seconds"], st["io_job_cpu_seconds"]
    return {"gb_s": st["bytes_read"] / wall / 1e9, "wall_s": wall,
            "read": read / thread_s, "crc": crc / thread_s, "observer": obs / thread_s,
            "bookkeeping": max(job - read - crc - obs, 0.0) / thread_s,
            "idle": max(thread_s - job, 0.0) / thread_s,
            "off_cpu": max(job - cpu, 0.0) / thread_s,
            "pread_gb_s_per_thread": st["bytes_read"] / max(read, 1e-9) / 1e9}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--pack", type=Path, help="the pack (default: written once under --pack-dir)")
    ap.add_argument("--pack-dir", type=Path, default=Path("packs"))
    ap.add_argument("--backend", default="cpu", help="the Window whose record observer runs")
    ap.add_argument("--io-threads", type=int, nargs="+", default=[StreamConfig.io_threads])
    ap.add_argument("--part-kib", type=int, default=StreamConfig.part_bytes >> 10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-rows", type=int, default=256, help="0: no prompt-shaped figure")
    ap.add_argument("--io-reference", type=Path,
                    help="the binary of benchmarks/native/cuda_io_reference.cu")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.io_reference and not args.io_reference.is_file():
        ap.error(f"--io-reference: no such file: {args.io_reference}")
    if args.rounds < 1 or args.part_kib < 4 or args.part_kib % 4 or min(args.io_threads) < 1:
        ap.error("--rounds and every --io-threads must be at least 1, --part-kib a multiple of 4")
    path = args.pack or args.pack_dir / "io_path_qwen3-30b-a3b-like.strpk"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        make_pack(path, 4, 128, 2048, 768, 8)
    path.read_bytes()  # warm the page cache
    part = args.part_kib << 10
    with ExpertPack.open(path) as pack:
        g, stride, first = pack.geometry, pack.record_stride, pack.records_offset
        record_bytes = pack.record_bytes
    n_all = g.n_layers * g.n_experts
    # The native reference reads whole parts of one span (no record boundaries): the records'
    # bytes, as many whole parts as they hold.
    span = n_all * stride // part * part
    print(f"{path}: {n_all} records of {record_bytes / 2**20:.2f} MiB ({n_all * stride / 1e9:.2f}"
          f" GB), parts of {args.part_kib} KiB, backend {args.backend}, {args.rounds} rounds",
          flush=True)  # fmt: skip

    results: dict[str, Any] = {"pack": str(path), "backend": args.backend,
                               "part_bytes": part, "records": n_all, "rows": []}  # fmt: skip
    for threads in args.io_threads:
        row = measure(args, path, threads, first, span)
        results["rows"].append(row)
        print_row(row, args.io_reference is not None)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


def measure(
    args: argparse.Namespace, path: Path, threads: int, first: int, span: int
) -> dict[str, Any]:
    """Every figure at `threads` IO threads, interleaved over the rounds; medians."""
    with ExpertPack.open(path) as pack:
        n_all, stride = pack.geometry.n_layers * pack.geometry.n_experts, pack.record_stride
    part, arena = args.part_kib << 10, n_all * stride
    cfg = StreamConfig(arena_bytes=arena, io_threads=threads, part_bytes=part,
                       direct_io=False, persist_profile=False)  # fmt: skip
    steps: list[tuple[str, Any]] = [
        ("raw_staging", lambda: raw(path, n_all, part, threads, 0, False)),
        ("raw_staging_crc", lambda: raw(path, n_all, part, threads, 0, True)),
        ("raw_arena", lambda: raw(path, n_all, part, threads, arena, False)),
        ("raw_arena_crc", lambda: raw(path, n_all, part, threads, arena, True)),
        ("engine_verify", lambda: engine_bulk(path, cfg, args.backend)),
        ("engine_no_verify",
         lambda: engine_bulk(path, cfg.replace(verify_reads=False), args.backend)),
    ]  # fmt: skip
    ref = args.io_reference
    if ref:
        steps += [
            ("native_staging", lambda: native(ref, path, first, span, part, threads, False)),
            ("native_arena", lambda: native(ref, path, first, span, part, threads, True)),
        ]
    runs: dict[str, list[Any]] = {}
    for r in range(args.rounds):
        # A different first step each round: drift in the machine's load falls on all alike.
        for name, fn in steps[r % len(steps) :] + steps[: r % len(steps)]:
            runs.setdefault(name, []).append(fn())
    row: dict[str, Any] = {"io_threads": threads}
    for name, values in runs.items():
        if isinstance(values[0], dict):
            keys = [k for k, v in values[0].items() if isinstance(v, float | int)]
            row[name] = {k: statistics.median(float(v[k]) for v in values) for k in keys}
        else:
            row[name] = statistics.median(values)
    if ref:
        row["pinned_h2d"] = row["native_staging"]["pinned_h2d_gb_s"]
    if args.prompt_rows:
        with ExpertPack.open(path) as pack:
            row["engine_prompt"] = engine_to_device(
                path, pack, cfg.replace(max_rows=args.prompt_rows), args.prompt_rows, args.seed,
                backend=args.backend,
            )  # fmt: skip
    return row


def print_row(row: dict[str, Any], cuda: bool) -> None:
    ev, en = row["engine_verify"], row["engine_no_verify"]
    print(f"\n{row['io_threads']} IO threads, GB/s (median):")
    print("| reader | verify on | verify off |")
    print("|---|---|---|")
    print(f"| raw, staging buffers | {row['raw_staging_crc']:.2f} | {row['raw_staging']:.2f} |")
    print(f"| raw, arena-sized destination | {row['raw_arena_crc']:.2f} | {row['raw_arena']:.2f} |")
    if cuda:
        print(f"| native CUDA reference (staging, copies overlapped) | | "
              f"{row['native_staging']['gb_s']:.2f} |")  # fmt: skip
        print(f"| native CUDA reference, arena-sized pinned destination | | "
              f"{row['native_arena']['gb_s']:.2f} |")  # fmt: skip
        print(f"| pinned host-to-device alone | | {row['pinned_h2d']:.2f} |")
    print(f"| engine, bulk (every record into its slot) | {ev['gb_s']:.2f} | {en['gb_s']:.2f} |")
    if "engine_prompt" in row:
        p = row["engine_prompt"]
        if p["first_s"] <= p["replay_s"]:  # the compute's noise is larger than the IO
            p["gb_s"] = float("nan")
        print(f"| engine, prompt-shaped (wall {p['first_s']:.3f} s less replay "
              f"{p['replay_s']:.3f} s) | {p['gb_s']:.2f} | |")  # fmt: skip
    print("\n| ratio | verify on | verify off |")
    print("|---|---|---|")
    print(
        f"| engine bulk / raw arena (the IO path's own cost) | "
        f"{ev['gb_s'] / row['raw_arena_crc']:.2f} | {en['gb_s'] / row['raw_arena']:.2f} |"
    )
    print(f"| engine bulk / raw staging | {ev['gb_s'] / row['raw_staging_crc']:.2f} | "
          f"{en['gb_s'] / row['raw_staging']:.2f} |")  # fmt: skip
    if cuda:
        ref, ref_arena = row["native_staging"]["gb_s"], row["native_arena"]["gb_s"]
        print(f"| engine bulk / native CUDA reference | {ev['gb_s'] / ref:.2f} | "
              f"{en['gb_s'] / ref:.2f} |")  # fmt: skip
        print(f"| engine bulk / native reference, arena destination | "
              f"{ev['gb_s'] / ref_arena:.2f} | {en['gb_s'] / ref_arena:.2f} |")  # fmt: skip
        print(f"| engine bulk / pinned host-to-device | {ev['gb_s'] / row['pinned_h2d']:.2f} | "
              f"{en['gb_s'] / row['pinned_h2d']:.2f} |")  # fmt: skip
        if "engine_prompt" in row:
            print(f"| engine prompt-shaped / native CUDA reference | "
                  f"{row['engine_prompt']['gb_s'] / ref:.2f} | |")  # fmt: skip
    elif "engine_prompt" in row:
        print(f"| engine prompt-shaped / raw staging | "
              f"{row['engine_prompt']['gb_s'] / row['raw_staging_crc']:.2f} | |")  # fmt: skip
    print("\nthe engine's IO threads' time (bulk), fractions of threads x wall:")
    print(
        "(pread, crc32c, observers and the rest of each part job sum to the jobs' time, of which "
        "'off CPU' was blocked on a lock or a copy, or waiting for a core)"
    )
    print("| verify | pread | crc32c | observers | rest of the job | idle | off CPU | "
          "pread GB/s a thread |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for name, e in (("on", ev), ("off", en)):
        print(f"| {name} | {e['read']:.2f} | {e['crc']:.2f} | {e['observer']:.2f} | "
              f"{e['bookkeeping']:.2f} | {e['idle']:.2f} | {e['off_cpu']:.2f} | "
              f"{e['pread_gb_s_per_thread']:.2f} |")  # fmt: skip
    sys.stdout.flush()


if __name__ == "__main__":
    raise SystemExit(main())
