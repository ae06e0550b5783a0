"""The CUDA backend on a GPU: layer times, the IO path to device slots, decode tokens/s.

    python benchmarks/cuda.py [--layers 2] [--experts 16] [--tokens 16] [--backends ...]
                              [--prompt-rows 128 512] [--decode] [--json OUT]
    python benchmarks/cuda.py --load OUT.json --plot docs/figures/cuda.png

Layer times. Writes a q4 (group 64, f16 scales) pack with the shapes of Qwen3-30B-A3B's experts
(hidden 2048, moe_intermediate 768, top-8; fewer layers and experts, which the per-layer time
does not depend on), keeps it all resident, and times Window.moe per layer for decode tokens and
for prompt chunks on each backend: wall microseconds per layer call (median), and the expert
bytes a decode layer reads over that time. A tiny pack (hidden 64) gives the handshake's own cost
per layer, the kernels being negligible there. cuda-device reads a device-memory mirror of the
arena (STRATA_CUDA_ARENA=device, the default); cuda-mapped reads the host arena through the
mapping (over PCIe).

--decode: a qwen3-30b-a3b-like pack (its expert shapes and 128 experts a layer, --decode-layers
layers; the per-token figures scale with the layer count) read through the page cache (packed
here, so warm). First the IO figures: the raw reference, pinned host-to-device bandwidth alone,
and the engine's own bytes per second from the page cache to device slots (a prompt that touches
every expert of every layer, all resident: its wall time over the same prompt replayed with every
expert already in place). The raw reference is native (--io-reference: the binary
benchmarks/native/cuda_io_reference.cu builds): --io-threads threads taking consecutive
--part-bytes parts, each pread into one of --io-depth pinned buffers a thread and copied to the
device with cudaMemcpyAsync, the copies overlapping the next preads; without the binary, a
Python version (one synchronous copy a part), which is not fair to the hardware. Then the
synthetic driver's decode tokens/s at each --fractions arena, next-layer prediction off and on,
beside the ceiling 1 / max(missed bytes per token / the best raw reference, all-resident seconds
per token), the best reference being the fastest native one among this run's threads and parts
and CEILING_IO_CONFIGS (so a run's own part size never lowers its ceiling); --decode-tokens
decode steps after a --prompt-token prompt, long enough that the cold start does not dominate.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from common import require_matplotlib
from strata_stream import ExpertPack, ExpertStream, StreamConfig, Window
from strata_stream.pack import Geometry, write_pack
from strata_stream.pack.quant import QuantizedMatrix
from strata_stream.synthetic import SyntheticDriver

BACKENDS = {  # name: (backend, STRATA_CUDA_ARENA)
    "cpu": ("cpu", ""),
    "cuda-device": ("cuda", "device"),
    "cuda-mapped": ("cuda", "mapped"),
}


def q4_matrix(rng: np.random.Generator, rows: int, cols: int) -> QuantizedMatrix:
    words = rng.integers(0, 2**32, (rows, cols // 8), dtype=np.uint32)
    scales = (rng.random((rows, cols // 64)) * 0.02).astype(np.float16)
    biases = (-8 * scales).astype(np.float16)
    return QuantizedMatrix(words, scales, biases, 4, 64)


def make_pack(path: Path, layers: int, experts: int, hidden: int, inter: int, k: int) -> Path:
    g = Geometry(layers, experts, k, hidden, inter, "softmax_topk", True)
    rng = np.random.default_rng(0)
    routers = [rng.standard_normal((experts, hidden)).astype(np.float32) for _ in range(layers)]

    def mats(layer: int, e: int) -> tuple[QuantizedMatrix, ...]:
        r = np.random.default_rng((layer, e))
        gate, up = q4_matrix(r, inter, hidden), q4_matrix(r, inter, hidden)
        return gate, up, q4_matrix(r, hidden, inter)

    write_pack(path, g, routers, mats, weight_format="q4", group_size=64, scale_dtype="f16",
               progress=False)  # fmt: skip
    return path


def time_layers(path: Path, backend: str, rows: int, calls: int) -> float:
    """Median wall microseconds of one Window.moe layer call of `rows` rows, all resident."""
    with ExpertPack.open(path) as p:
        g, stride = p.geometry, p.record_stride
    cfg = StreamConfig(arena_bytes=g.n_layers * g.n_experts * stride, direct_io=False,
                       persist_profile=False, max_rows=max(rows, 1))  # fmt: skip
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((rows, g.hidden)).astype(np.float32) for _ in range(g.n_layers)]
    us: list[float] = []
    with ExpertStream(path, cfg) as stream, Window(stream, backend=backend) as w:
        for turn in range(calls + 2):
            with w.turn():
                for layer, x in enumerate(xs):
                    t0 = time.perf_counter()
                    w.moe(layer, x)
                    if turn >= 2:  # the first turns read the experts in
                        us.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(us)


def torch_prompt_us(rows: int, experts: int, hidden: int, inter: int, k: int) -> float | None:
    """torch's bf16 reference for one prompt layer's expert work (rows * k entries spread evenly
    over the experts, each expert a gate/up matmul, SwiGLU and a down matmul), median us;
    None without torch or a GPU."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    dev, bf = "cuda", torch.bfloat16
    per = rows * k // experts
    x = torch.randn(experts, per, hidden, device=dev, dtype=bf)
    w1 = torch.randn(experts, hidden, 2 * inter, device=dev, dtype=bf) / hidden**0.5
    w2 = torch.randn(experts, inter, hidden, device=dev, dtype=bf) / inter**0.5

    def layer() -> object:
        gu = torch.bmm(x, w1)  # one batched matmul over the experts: equal group sizes
        g, u = gu[..., :inter], gu[..., inter:]
        return torch.bmm(torch.nn.functional.silu(g) * u, w2)

    for _ in range(3):
        layer()
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        layer()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def layer_times(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    tiny = make_pack(tmp / "tiny.strpk", 4, 16, 64, 64, 4)
    big = make_pack(tmp / "qwen3.strpk", args.layers, args.experts, 2048, 768, 8)
    with ExpertPack.open(big) as p:
        decode_bytes = 8 * p.record_bytes
    for name in args.backends:
        backend, arena = BACKENDS[name]
        os.environ["STRATA_CUDA_ARENA"] = arena  # read when a CUDA backend is made
        r: dict[str, float] = {}
        r["handshake_layer_us"] = time_layers(tiny, backend, 1, args.tokens)
        r["decode_layer_us"] = time_layers(big, backend, 1, args.tokens)
        r["decode_gb_s"] = decode_bytes / (r["decode_layer_us"] * 1e-6) / 1e9
        for rows in args.prompt_rows:
            r[f"prompt{rows}_layer_us"] = time_layers(big, backend, rows, 2)
        results[name] = r
        print(name, json.dumps(r), flush=True)
    os.environ.pop("STRATA_CUDA_ARENA", None)
    torch_r: dict[str, float] = {}
    for rows in args.prompt_rows:
        t = torch_prompt_us(rows, args.experts, 2048, 768, 8)
        if t is not None:
            torch_r[f"prompt{rows}_layer_us"] = t
    if torch_r:
        results["torch-bf16-bmm"] = torch_r
        print("torch-bf16-bmm", json.dumps(torch_r), flush=True)
    return results


# (IO threads, part bytes) at which the native reference is also measured for the decode
# ceiling: the default and the neighbours the decode runs try, up to 16 threads (the H200 host's
# cores), so that a run with more IO threads is held to the best reference at that many too.
CEILING_IO_CONFIGS = ((4, 1 << 20), (8, 1 << 20), (8, 1 << 18), (16, 1 << 20))


def raw_reference(path: Path, offset: int, size: int, part: int, threads: int) -> float:
    """Bytes/s of the fair raw path to the device: `threads` threads taking consecutive parts,
    each pread (page cache) into the thread's pinned buffer and then copied to the device on
    the thread's own stream, waited for before the buffer is reused."""
    import torch

    fd = os.open(path, os.O_RDONLY)
    n_parts = size // part
    done = [0] * threads

    def run(j: int) -> None:
        pinned = torch.empty(part, dtype=torch.uint8).pin_memory()
        view = memoryview(pinned.numpy())
        dev = torch.empty(part, dtype=torch.uint8, device="cuda")
        s = torch.cuda.Stream()
        for i in range(j, n_parts, threads):
            done[j] += os.preadv(fd, [view], offset + i * part)
            with torch.cuda.stream(s):
                dev.copy_(pinned, non_blocking=True)
            s.synchronize()

    workers = [threading.Thread(target=run, args=(j,)) for j in range(threads)]
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    wall = time.perf_counter() - t0
    os.close(fd)
    return sum(done) / wall


def native_reference(binary: Path, path: Path, offset: int, size: int, part: int, threads: int,
                     depth: int) -> dict[str, Any]:  # fmt: skip
    """The native raw reference (benchmarks/native/cuda_io_reference.cu): its JSON line."""
    run = subprocess.run(
        [str(binary), str(path), str(offset), str(size), str(part), str(threads), str(depth)],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    result: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    return result


def pinned_h2d(size: int = 1 << 28) -> float:
    """Bytes/s of one pinned host buffer copied to the device (median of 5)."""
    import torch

    src = torch.empty(size, dtype=torch.uint8).pin_memory()
    dst = torch.empty(size, dtype=torch.uint8, device="cuda")
    dst.copy_(src)
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return size / statistics.median(times)


def engine_to_device(
    path: Path, pack: ExpertPack, cfg: StreamConfig, rows: int, seed: int, backend: str = "cuda"
) -> dict[str, float]:
    """The prompt-shaped IO figure: the engine's bytes/s from the page cache to device slots
    over a `rows`-token prompt over every layer, all resident, on a fresh stream (every expert
    it routes to is read, copied into the arena and then into its device slot), against the
    same prompt replayed once all of them are in place (the compute alone). A layer's urgent
    reads start at its host point, and the wall time less the replay counts whatever of them
    the compute did not hide: IO in the prompt's shape, not the IO path's own throughput
    (benchmarks/io_path.py measures both)."""
    g, routers = pack.geometry, pack.router_weights  # routers are read lazily: pack stays open
    walls: list[float] = []
    reads: list[int] = []
    with ExpertStream(path, cfg) as stream, Window(stream, backend=backend) as window:
        with window.turn():  # the backend's first launches and copies, outside the timing
            window.moe(0, SyntheticDriver(g, routers, seed=seed + 1).prompt(1).layer_input(0))
        for _ in range(2):
            x = SyntheticDriver(g, routers, seed=seed).prompt(rows)
            before = stream.stats()["bytes_read"]
            t0 = time.perf_counter()
            with window.turn():
                for layer in range(g.n_layers):
                    window.moe(layer, x.layer_input(layer))
            walls.append(time.perf_counter() - t0)
            reads.append(stream.stats()["bytes_read"] - before)
    io_s = max(walls[0] - walls[1], 1e-9)
    return {"bytes": float(reads[0]), "first_s": walls[0], "replay_s": walls[1],
            "replay_bytes": float(reads[1]), "gb_s": reads[0] / io_s / 1e9}  # fmt: skip


def decode(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).parent))
    from decode import decode_run  # the synthetic driver's timed decode (benchmarks/decode.py)

    path = args.decode_pack or tmp / "qwen3-30b-a3b-like.strpk"
    if not path.is_file():
        t0 = time.perf_counter()
        make_pack(path, args.decode_layers, 128, 2048, 768, 8)
        print(f"packed {path.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s",
              flush=True)  # fmt: skip
    out: dict[str, Any] = {"layers": args.decode_layers, "experts": 128, "backend": "cuda"}
    with ExpertPack.open(path) as pack:
        g, stride, first = pack.geometry, pack.record_stride, pack.records_offset
        if (g.n_layers, g.n_experts, g.hidden, g.moe_intermediate, g.top_k) != (
            args.decode_layers, 128, 2048, 768, 8
        ):
            raise SystemExit(f"--decode-pack {path}: not a {args.decode_layers}-layer "
                             "qwen3-30b-a3b-like pack (another geometry)")  # fmt: skip
        n_all = g.n_layers * g.n_experts
        base = StreamConfig(io_threads=args.io_threads, part_bytes=args.part_bytes,
                            io_spin_us=args.io_spin_us, direct_io=False,
                            persist_profile=False)  # fmt: skip
        def region(part: int) -> int:  # the references' bytes: up to 1 GiB, whole parts
            return int(min(n_all * stride, 1 << 30) // part * part)

        size = region(args.part_bytes)
        python_raw = raw_reference(path, first, size, args.part_bytes, args.io_threads)
        io: dict[str, Any] = {"python_reference_gb_s": python_raw / 1e9,
                              "pinned_h2d_gb_s": pinned_h2d() / 1e9}  # fmt: skip
        raw = python_raw
        if args.io_reference:
            native = native_reference(args.io_reference, path, first, size, args.part_bytes,
                                      args.io_threads, args.io_depth)  # fmt: skip
            io["native_reference"] = native
            raw = native["gb_s"] * 1e9
        io["raw_reference_gb_s"] = raw / 1e9
        # The ceiling's IO bandwidth is the best the machine reaches, not this run's threads and
        # parts: a part size that shortens a miss but slows the bulk reference must not raise
        # the "of the ceiling" figures by lowering the ceiling.
        ceiling_io = raw
        if args.io_reference:
            for threads, part in CEILING_IO_CONFIGS:
                if (threads, part) != (args.io_threads, args.part_bytes):
                    other = native_reference(args.io_reference, path, first, region(part),
                                             part, threads, args.io_depth)  # fmt: skip
                    io.setdefault("other_references", []).append(other)
                    ceiling_io = max(ceiling_io, other["gb_s"] * 1e9)
        io["ceiling_reference_gb_s"] = ceiling_io / 1e9
        io["engine"] = engine_to_device(
            path, pack, base.replace(arena_bytes=n_all * stride, max_rows=256), 256, args.seed
        )
        io["engine_over_reference"] = io["engine"]["gb_s"] * 1e9 / raw
        io["engine_over_pinned_h2d"] = io["engine"]["gb_s"] / io["pinned_h2d_gb_s"]
        out["io"] = io
        print("io", json.dumps(out["io"]), flush=True)
        resident = decode_run(path, pack, base.replace(arena_bytes=n_all * stride,
                              lookahead=False), args.prompt, args.decode_tokens, args.seed,
                              replay=True, backend="cuda")  # fmt: skip
        compute_s = resident["seconds_per_token"]
        out["all_resident_tokens_per_s"] = 1 / compute_s
        rows = []
        for fraction in args.fractions:
            for lookahead in (False, True):
                n_slots = max(2 * g.top_k, int(n_all * fraction))
                r = decode_run(path, pack, base.replace(arena_bytes=n_slots * stride,
                               lookahead=lookahead), args.prompt, args.decode_tokens,
                               args.seed, backend="cuda")  # fmt: skip
                ceiling = 1 / max(r["bytes_read_per_token"] / ceiling_io, compute_s)
                row = {"arena_fraction": fraction, "lookahead": lookahead,
                       "ceiling_tokens_per_s": ceiling,
                       "fraction_of_ceiling": r["tokens_per_s"] / ceiling, **r}  # fmt: skip
                rows.append(row)
                print(f"arena {fraction:4.0%} prediction {'on ' if lookahead else 'off'}: "
                      f"{r['tokens_per_s']:7.1f} tok/s, ceiling {ceiling:7.1f} "
                      f"({row['fraction_of_ceiling']:.2f}), hit rate {r['hit_rate']:.3f}, "
                      f"{r['bytes_read_per_token'] / 1e6:.0f} MB/token", flush=True)  # fmt: skip
        out["rows"] = rows
    return out


def plot(results: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dec = results.get("decode")
    kern = results.get("kernels")  # the decode kernels alone (benchmarks/native/cuda_kernel_bench)
    n = 1 + bool(dec) + bool(kern)
    fig, axes = plt.subplots(1, n, figsize=(6 * n, 4.2), squeeze=False)
    ax = axes[0][0]
    layers = results.get("layers", {})
    names = [n for n in layers if "handshake_layer_us" in layers[n]]
    xs = np.arange(len(names))
    bars = (("handshake_layer_us", "tiny layer (handshake)"),
            ("decode_layer_us", "decode layer (Qwen3-30B-A3B q4)"))  # fmt: skip
    for i, (key, label) in enumerate(bars):
        ax.bar(xs + (i - 0.5) * 0.38, [layers[n][key] for n in names], 0.38, label=label)
    ax.set_xticks(xs, names, rotation=15, fontsize=8)
    ax.set_ylabel("us per layer call (median)")
    ax.set_title("Window.moe per layer, all resident")
    ax.legend()
    if dec:
        ax = axes[0][1]
        for lookahead, marker in ((False, "o"), (True, "s")):
            rows = [r for r in dec["rows"] if r["lookahead"] == lookahead]
            f = [100 * r["arena_fraction"] for r in rows]
            ax.plot(f, [r["tokens_per_s"] for r in rows], marker=marker,
                    label=f"{dec.get('backend', 'cuda')}, prediction "
                          f"{'on' if lookahead else 'off'}")  # fmt: skip
            ax.plot(f, [r["ceiling_tokens_per_s"] for r in rows], marker=marker, ls=":",
                    color="grey", label="ceiling" if lookahead else None)  # fmt: skip
        lazy = results.get("decode_lazy")  # the same call with STRATA_CUDA_MIRROR_FILL=lazy
        for lookahead, marker in ((False, "o"), (True, "s")) if lazy else ():
            rows = [r for r in lazy["rows"] if r["lookahead"] == lookahead]
            ax.plot([100 * r["arena_fraction"] for r in rows], [r["tokens_per_s"] for r in rows],
                    marker=marker, ls="--", alpha=0.5, fillstyle="none",
                    label=f"lazy copies, prediction {'on' if lookahead else 'off'}")  # fmt: skip
        ax.set_xlabel("arena, % of the experts")
        ax.set_ylabel("tokens/s")
        ax.set_yscale("log")
        ax.set_title(f"decode, {dec['layers']} qwen3-30b-a3b-like layers, page cache")
        ax.legend()
    if kern:
        ax = axes[0][n - 1]
        ops = (("route_staged_x_us", "route_bytes", "route"), ("gate_up_us", "gate_up_bytes",
               "gate_up"), ("down_us", "down_bytes", "down"))  # fmt: skip
        xs = np.arange(len(ops))
        for i, (name, r) in enumerate(kern.items()):
            us = [r[key] for key, _, _ in ops]
            bars = ax.bar(xs + (i - (len(kern) - 1) / 2) * 0.38, us, 0.38, label=name)
            for bar, (key, nbytes, _) in zip(bars, ops, strict=True):
                roof = r[nbytes] / (r["d2d_gb_s"] * 1e9) / (r[key] * 1e-6)
                ax.annotate(f"{roof:.2f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=7)  # fmt: skip
        ax.set_xticks(xs, [label for _, _, label in ops])
        ax.set_yscale("log")
        ax.set_ylabel("us per launch (CUDA events, median)")
        ax.set_title("decode kernels, 128 experts (labels: fraction of the HBM roofline)")
        ax.legend()
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--backends", nargs="*", choices=sorted(BACKENDS), default=list(BACKENDS))
    ap.add_argument("--prompt-rows", type=int, nargs="*", default=[128, 512])
    ap.add_argument("--decode", action="store_true", help="the IO and decode-throughput figures")
    ap.add_argument("--decode-layers", type=int, default=4)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--decode-pack", type=Path,
                    help="the --decode pack: written there when absent, else reused")  # fmt: skip
    ap.add_argument("--write-decode-pack", action="store_true",
                    help="only write --decode-pack (while something else runs)")  # fmt: skip
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.10, 0.25, 0.50, 1.00])
    ap.add_argument("--io-threads", type=int, default=StreamConfig.io_threads)
    ap.add_argument("--part-bytes", type=int, default=StreamConfig.part_bytes)
    ap.add_argument("--io-spin-us", type=int, default=StreamConfig.io_spin_us)
    ap.add_argument("--io-depth", type=int, default=2, help="pinned buffers a reference thread")
    ap.add_argument(
        "--io-reference",
        type=Path,
        help="the native raw reference (benchmarks/native/cuda_io_reference.cu)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--load", type=Path, help="plot a JSON an earlier run wrote; measure nothing")
    ap.add_argument("--plot", type=Path, help="a PNG of the figures")
    args = ap.parse_args()
    require_matplotlib(ap, args.plot)
    if args.io_reference and not args.io_reference.is_file():
        ap.error(f"--io-reference: no such file: {args.io_reference}")
    if args.io_depth < 1:
        ap.error(f"--io-depth must be at least 1, got {args.io_depth}")
    if args.write_decode_pack:
        if not args.decode_pack:
            ap.error("--write-decode-pack needs --decode-pack")
        make_pack(args.decode_pack, args.decode_layers, 128, 2048, 768, 8)
        return 0
    if args.load:
        results = json.loads(args.load.read_text())
    else:
        results = {}
        with tempfile.TemporaryDirectory() as tmp:
            if args.backends:
                results["layers"] = layer_times(args, Path(tmp))
            if args.decode:
                results["decode"] = decode(args, Path(tmp))
        if args.json:
            args.json.write_text(json.dumps(results, indent=2) + "\n")
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
