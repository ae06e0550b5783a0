"""Prefetch policies side by side: tokens/s, bytes read, warm-turn latency and memory, one run.

    python benchmarks/policies.py [--pack P] [--json OUT] [--plot OUT.png] [--quick]

On the qwen3-30b-a3b preset pack with O_DIRECT, at arenas of 10, 25 and 50% of the experts,
every policy below runs the same synthetic workload (benchmarks/decode.py's driver): a cold
prompt turn, a decode turn of --tokens steps, then a warm prompt turn. Measured per policy:
prompt and decode tokens/s, bytes read per token (decode) and per prompt token, hit rate, stall,
the warm prompt turn's wall time and its first layer call (where the prompt scratch is
reallocated unless BUF_REUSE keeps it), resident memory (RSS) after that turn ends, and the
back-off governor's state.

    on-demand        lookahead off, no profile fallback, no back-off: reads only what is routed
    profile          lookahead off, the profile ranks the next layer's prefetch (no back-off)
    l+1              router l+1 predicts (PUBLISH_PREFETCH 1, START_LAYERS 1, BUF_REUSE 0)
    l+1+l+2          l+1, plus router l+2 in prompt and decode (PRED2 + PREFETCH2)
    publish=0        l+1 with STRATA_METAL_PUBLISH_PREFETCH=0
    start_layers=4   l+1 with STRATA_METAL_PROMPT_START_LAYERS=4
    buf_reuse=1      l+1 with STRATA_METAL_PROMPT_BUF_REUSE=1
    l+1 backoff      l+1 with the PrefetchGovernor on (STRATA_PREFETCH_BACKOFF=1)

Busy SSD: on-demand, l+1 and l+1 backoff run again while background threads read another part
of the pack with O_DIRECT as fast as they can (--busy-threads of them, 1 MiB reads), the case
where public reports see next-layer prefetch lose 13-38%. The background bandwidth is reported.
These rows decode --busy-tokens steps (default 14): the governor's first trial (prefetch off
and on, compared by layer-call wall time) starts after 8 decode tokens and takes 4.

--noisy adds the same three policies on a workload whose routing the next layer's router
predicts badly (the driver's innovation raised to 4.0: precision ~0.5 instead of ~0.9), where
l+1 reads far more than on-demand and the governor's precision test should cut it.

The expert popularity profile matters to `profile` and `start_layers=4`. Every run starts from
the same one, computed from the driver's routing of a different sequence (seed + 1000) and
stored beside a symlink to the pack in a scratch directory, so nothing is written beside the
pack and no run inherits what an earlier one learned.

--quick packs the tiny preset (4 layers x 16 experts) into --pack-dir and runs a few tokens: a
smoke test of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from common import ensure_pack, require_matplotlib
from strata_stream import ExpertPack, ExpertStream, StreamConfig, Window
from strata_stream.pack import Geometry
from strata_stream.synthetic import DriverKnobs, SyntheticDriver, route_ids
from strata_stream.window import profile_path

NO_PREFETCH = {"lookahead": False, "profile_prefetch": False, "prefetch_backoff": False}
L1 = {"lookahead": True, "prefetch_backoff": False}
POLICIES: dict[str, dict[str, Any]] = {
    "on-demand": NO_PREFETCH,
    "profile": {**NO_PREFETCH, "profile_prefetch": True},
    "l+1": L1,
    "l+1+l+2": {**L1, "two_layer_prompt": True, "two_layer_decode": True},
    "publish=0": {**L1, "publish_prefetch": False},
    "start_layers=4": {**L1, "start_layers": 4},
    "buf_reuse=1": {**L1, "prompt_buf_reuse": True},
    "l+1 backoff": {**L1, "prefetch_backoff": True},
}
VARIANT_POLICIES = ("on-demand", "l+1", "l+1 backoff")  # the busy and noisy rows
NOISY_INNOVATION = 4.0

Inputs = list[np.ndarray]  # one [T, hidden] array per layer


def rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None


class Workload:
    """The inputs every policy sees: prompt, decode steps, second prompt (same driver seed)."""

    def __init__(
        self,
        g: Geometry,
        pack: ExpertPack,
        prompt: int,
        tokens: int,
        seed: int,
        knobs: DriverKnobs | None = None,
    ) -> None:
        driver = SyntheticDriver(g, pack.router_weights, seed=seed, knobs=knobs)
        layers = range(g.n_layers)
        p1 = driver.prompt(prompt)
        self.prompt1: Inputs = [p1.layer_input(layer) for layer in layers]
        self.decode: list[Inputs] = []
        for _ in range(tokens):
            t = driver.decode()
            self.decode.append([t.layer_input(layer) for layer in layers])
        p2 = driver.prompt(prompt)
        self.prompt2: Inputs = [p2.layer_input(layer) for layer in layers]


def learned_profile(g: Geometry, pack: ExpertPack, prompt: int, tokens: int, seed: int) -> Any:
    """Expert popularity [n_layers, n_experts] of another sequence of the same driver."""
    w = Workload(g, pack, prompt, tokens, seed + 1000)
    counts = np.zeros((g.n_layers, g.n_experts), np.uint32)
    for xs in [w.prompt1, *w.decode, w.prompt2]:
        for layer, x in enumerate(xs):
            ids = route_ids(x, pack.router_weights(layer), g.top_k)
            counts[layer] += np.bincount(ids.ravel(), minlength=g.n_experts).astype(np.uint32)
    return counts


@contextmanager
def busy_ssd(path: Path, offset: int, size: int, threads: int) -> Iterator[dict[str, float]]:
    """Background O_DIRECT readers looping over [offset, offset + size) until the block ends."""
    import mmap

    part = 1 << 20
    flags = os.O_RDONLY | getattr(os, "O_DIRECT", 0)
    try:
        fd = os.open(path, flags)
        direct = True
    except OSError:  # a file system without O_DIRECT: the load is then partly page cache
        fd = os.open(path, os.O_RDONLY)
        direct = False
    stop = threading.Event()
    done = [0] * threads
    n_parts = max(1, size // part)

    def run(j: int) -> None:
        buf = mmap.mmap(-1, part)  # page-aligned, as O_DIRECT requires
        i = j
        while not stop.is_set():
            done[j] += os.preadv(fd, [buf], offset + (i % n_parts) * part)
            i += threads

    report: dict[str, float] = {}
    workers = [threading.Thread(target=run, args=(j,), daemon=True) for j in range(threads)]
    t0 = time.perf_counter()
    for t in workers:
        t.start()
    try:
        yield report
    finally:
        stop.set()
        for t in workers:
            t.join()
        os.close(fd)
        report["background_gbps"] = sum(done) / (time.perf_counter() - t0) / 1e9
        report["background_direct_io"] = float(direct)


def run_policy(
    link: Path, config: StreamConfig, work: Workload, profile: Any, n_layers: int
) -> dict[str, Any]:
    np.save(profile_path(link), profile)  # every run starts from the same profile
    with ExpertStream(link, config) as stream, Window(stream) as window:

        def prompt_turn(xs: Inputs) -> tuple[float, float, int]:
            before = stream.stats()["bytes_read"]
            t0 = time.perf_counter()
            with window.turn():
                window.moe(0, xs[0])
                first = time.perf_counter() - t0
                for layer in range(1, n_layers):
                    window.moe(layer, xs[layer])
            return time.perf_counter() - t0, first, stream.stats()["bytes_read"] - before

        prompt_s, _, prompt_bytes = prompt_turn(work.prompt1)
        window.reset_stats()
        before = stream.stats()
        t0 = time.perf_counter()
        with window.turn():
            for xs in work.decode:
                for layer in range(n_layers):
                    window.moe(layer, xs[layer])
        decode_s = time.perf_counter() - t0
        after = stream.stats()
        total = window.stats()["total"]
        warm_s, warm_first_s, _ = prompt_turn(work.prompt2)
        st = window.stats()
        n_prompt = int(work.prompt1[0].shape[0])
        n_decode = len(work.decode)
        return {
            "prompt_tokens_per_s": n_prompt / prompt_s,
            "prompt_bytes_per_token": prompt_bytes / n_prompt,
            "decode_tokens_per_s": n_decode / decode_s,
            "decode_bytes_per_token": (after["bytes_read"] - before["bytes_read"]) / n_decode,
            "decode_hit_rate": total["hit_rate"],
            "decode_stall_s_per_token": total["stall_seconds"] / n_decode,
            "decode_recall": total["recall"],
            "spec_reads_per_token": (after["spec_requests"] - before["spec_requests"]) / n_decode,
            "spec_used_per_token": (after["spec_hits"] - before["spec_hits"]) / n_decode,
            "warm_turn_s": warm_s,
            "warm_first_layer_s": warm_first_s,
            "rss_after_turn_bytes": rss_bytes(),
            "scratch_after_turn_bytes": st["scratch_bytes"],
            "arena_bytes": config.arena_bytes,
            "direct_io": stream.direct_io,
            "prefetch": st["prefetch"],
        }


def plot(rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fractions = sorted({r["arena_fraction"] for r in rows})
    labels = list(dict.fromkeys(r["label"] for r in rows))
    metrics = [
        ("decode_tokens_per_s", "decode tokens/s"),
        ("prompt_tokens_per_s", "prompt tokens/s"),
        ("decode_bytes_per_token", "decode MB read / token"),
    ]
    fig, axes = plt.subplots(len(metrics), 1, figsize=(max(8, 1.2 * len(labels)), 11))
    width = 0.8 / len(labels)
    cmap = plt.get_cmap("tab20")
    for ax, (key, title) in zip(axes, metrics, strict=True):
        for i, label in enumerate(labels):
            ys = []
            for f in fractions:
                r = next(
                    (r for r in rows if r["label"] == label and r["arena_fraction"] == f), None
                )
                v = r[key] if r else 0.0
                ys.append(v / 1e6 if key.endswith("bytes_per_token") else v)
            xs = [j + (i - (len(labels) - 1) / 2) * width for j in range(len(fractions))]
            hatch = (
                "//" if label.startswith("busy") else ".." if label.startswith("noisy") else None
            )
            ax.bar(xs, ys, width, label=label, color=cmap(i % 20), hatch=hatch)
        ax.set_xticks(range(len(fractions)), [f"arena {f:.0%}" for f in fractions])
        ax.set_title(title)
    axes[0].legend(ncol=4, fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--pack", type=Path)
    ap.add_argument("--pack-dir", type=Path, default=Path("packs"))
    ap.add_argument("--quick", action="store_true", help="tiny preset, few tokens: a smoke test")
    ap.add_argument("--prompt", type=int, default=8, help="prompt tokens per prompt turn")
    ap.add_argument("--tokens", type=int, default=6, help="decode steps")
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.10, 0.25, 0.50])
    ap.add_argument("--policies", nargs="+", choices=list(POLICIES), default=list(POLICIES))
    ap.add_argument("--no-busy", action="store_true", help="skip the busy-SSD rows")
    ap.add_argument("--busy-threads", type=int, default=2)
    ap.add_argument("--busy-tokens", type=int, default=14, help="decode steps, busy/noisy rows")
    ap.add_argument("--noisy", action="store_true", help="add the badly-predicted workload")
    ap.add_argument("--io-threads", type=int, default=StreamConfig.io_threads)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args()
    require_matplotlib(ap, args.plot)
    if args.quick:
        path = ensure_pack(args.pack, "tiny", Path(tempfile.gettempdir()) / "strata_policies")
        args.prompt, args.tokens = min(args.prompt, 6), min(args.tokens, 4)
        args.noisy = True
    else:
        path = ensure_pack(args.pack, "qwen3-30b-a3b", args.pack_dir)

    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    with ExpertPack.open(path) as pack, tempfile.TemporaryDirectory() as scratch:
        g = pack.geometry
        stride = pack.record_stride
        n_all = g.n_layers * g.n_experts
        link = Path(scratch) / path.name  # the profile lives beside this, not beside the pack
        link.symlink_to(path.resolve())
        works = {
            "idle": Workload(g, pack, args.prompt, args.tokens, args.seed),
            "busy": Workload(g, pack, args.prompt, args.busy_tokens, args.seed),
        }
        if args.noisy:
            knobs = DriverKnobs(innovation=NOISY_INNOVATION)
            works["noisy"] = Workload(g, pack, args.prompt, args.busy_tokens, args.seed, knobs)
        profile = learned_profile(g, pack, args.prompt, args.tokens, args.seed)
        base = StreamConfig(io_threads=args.io_threads, direct_io=True, persist_profile=True)
        # The background reader takes the half of the records the arena fills last.
        busy_offset = pack.records_offset + n_all // 2 * stride
        busy_size = pack.file_bytes - busy_offset
        plan = [(name, "idle") for name in args.policies]
        variants = ([] if args.no_busy else ["busy"]) + (["noisy"] if args.noisy else [])
        for variant in variants:
            plan += [(name, variant) for name in VARIANT_POLICIES if name in args.policies]
        print(
            f"{path} ({g.n_layers} layers x {g.n_experts} experts, top {g.top_k}, "
            f"{stride / 1e6:.2f} MB/record); prompt {args.prompt} tokens, {args.tokens} decode"
        )
        header = (
            f"{'arena':>5} {'policy':<22} {'prompt t/s':>10} {'decode t/s':>10} "
            f"{'MB/dec tok':>10} {'MB/pr tok':>9} {'hit':>5} {'warm ms':>8} "
            f"{'1st ms':>7} {'RSS MB':>7} {'governor':>20} {'bg GB/s':>7}"
        )
        print(header)
        for fraction in args.fractions:
            n_slots = max(2 * g.top_k, int(n_all * fraction))
            for name, variant in plan:
                config = base.replace(arena_bytes=n_slots * stride, **POLICIES[name])
                bg: dict[str, float] = {}
                if variant == "busy":
                    with busy_ssd(path, busy_offset, busy_size, args.busy_threads) as bg:
                        r = run_policy(link, config, works["busy"], profile, g.n_layers)
                else:
                    r = run_policy(link, config, works[variant], profile, g.n_layers)
                label = name if variant == "idle" else f"{variant}: {name}"
                row = {
                    "arena_fraction": fraction,
                    "n_slots": n_slots,
                    "policy": name,
                    "variant": variant,
                    "busy": variant == "busy",
                    "label": label,
                    **bg,
                    **r,
                }
                rows.append(row)
                p = r["prefetch"]
                gov = p["state"] if p["cap"] is None else f"{p['state']} cap {p['cap']}"
                if p["trials"]:
                    gov += f" t{p['trials']}"
                rss = r["rss_after_turn_bytes"]
                print(
                    f"{fraction:5.0%} {label:<22} {r['prompt_tokens_per_s']:10.2f} "
                    f"{r['decode_tokens_per_s']:10.2f} {r['decode_bytes_per_token'] / 1e6:10.1f} "
                    f"{r['prompt_bytes_per_token'] / 1e6:9.1f} "
                    f"{(r['decode_hit_rate'] or 0):5.2f} {r['warm_turn_s'] * 1e3:8.0f} "
                    f"{r['warm_first_layer_s'] * 1e3:7.1f} "
                    f"{(rss / 1e6 if rss is not None else float('nan')):7.0f} {gov:>20} "
                    f"{bg.get('background_gbps', float('nan')):7.2f}",
                    flush=True,
                )
    elapsed = time.perf_counter() - started
    print(f"{len(rows)} runs in {elapsed:.0f} s")
    print("governor: state [cap] [tN = N trials]; 'disabled' = back-off off")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "pack": str(path),
                    "geometry": {
                        "n_layers": g.n_layers,
                        "n_experts": g.n_experts,
                        "top_k": g.top_k,
                        "record_stride": stride,
                    },
                    "prompt_tokens": args.prompt,
                    "decode_tokens": args.tokens,
                    "variant_decode_tokens": args.busy_tokens,
                    "noisy_innovation": NOISY_INNOVATION if args.noisy else None,
                    "io_threads": args.io_threads,
                    "busy_threads": args.busy_threads,
                    "quick": args.quick,
                    "elapsed_s": elapsed,
                    "rows": rows,
                },
                indent=2,
            )
            + "\n"
        )
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
