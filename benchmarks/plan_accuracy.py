"""`strata-stream plan`'s predictions against real streamed decodes of the same models.

    python benchmarks/plan_accuracy.py [--tokens 48] [--repeats 3] [--shares 0.25 0.5]
                                       [--json OUT]

Models (random-weight mlx-lm checkpoints, q4 g64 as `mlx_lm.convert -q` writes them, built
offline by strata_stream.mlx_lm.random_model):
- tests:  the tests' tiny qwen3_moe (3 layers x 8 experts, top-2, hidden 64);
- demo:   `strata-stream demo`'s model (4 layers x 16 experts, top-2, hidden 128);
- traced: 4 layers x 128 experts, top-6, hidden 128, every block routed by the shipped
  Qwen3-30B-A3B trace (strata_stream.trace.routing.route_by_trace), so its routing is the
  trace's: what plan's default (the Qwen3 trace scaled to the geometry) assumes. It runs twice:
  through the page cache (the engine's choice for a pack this small) and with direct reads
  (STRATA_DIRECT_IO=1: the disk, as a pack larger than memory is read).

Each model first decodes with every expert resident, recording its routing (StreamConfig's
trace_path): the measured compute ceiling, and a recorded trace for plan. Then it decodes with
arenas of each --shares of its experts (at least the minimum, 2 x top-k). Every run is a fresh
subprocess of this script (the hidden --one flag), the configurations interleaved across
--repeats; decode tokens/s is mlx-lm's generation_tps after one warm-up generation (sampled at
temperature 1, one seed for all, so every run draws the same tokens), and the hit rate the
engine's over the decode tokens only.

For each run plan is asked (its Python API, `make_plan`, with the arena the run had and doctor's
saved measurement: run `strata-stream doctor` first):
- default:  plan's own choices: the shipped trace (the random models have no recorded trace
  beside their cached pack here) and the compute ceiling estimated from the bytes a token reads;
- trace:    the model's recorded trace (the traced model: the shipped trace, which is its
  routing), compute still estimated;
- measured compute: as `trace`, with --compute-tps the all-resident runs' tokens/s (their best
  against each configuration's best run, their median against its median).
A prediction is a range; its error is measured / nearest end of the range (1.00 inside it). On
a loaded machine the best of the repeats is the run the load disturbed least.

`--summarize JSON` prints the table again from an earlier run's --json, with the plan code and
doctor measurement of now (its models must still be in their temporary folder).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
QWEN3_TRACE = ROOT / "tests" / "data" / "qwen3-30b-a3b.route.csv"
# name -> (make_checkpoint dims, routed by the Qwen3 trace, direct reads)
MODELS: dict[str, tuple[dict[str, Any], bool, bool]] = {
    "tests": ({}, False, False),
    "demo": (
        {
            "hidden_size": 128,
            "num_hidden_layers": 4,
            "num_experts": 16,
            "moe_intermediate_size": 128,
        },
        False,
        False,
    ),
    "traced": (
        {
            "hidden_size": 128,
            "num_hidden_layers": 4,
            "num_experts": 128,
            "num_experts_per_tok": 6,
            "moe_intermediate_size": 128,
        },
        True,
        False,
    ),
}
MODELS["traced-direct"] = (MODELS["traced"][0], True, True)
_PROMPT = " ".join(f"w{i * 7 % 60}" for i in range(16))


def one(args: argparse.Namespace) -> dict[str, Any]:
    """One decode in this process: a warm-up generation, then the measured one."""
    import mlx.core as mx
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from strata_stream.config import StreamConfig
    from strata_stream.mlx_lm import load

    changes: dict[str, Any] = {"persist_profile": False}
    if args.direct:
        changes["direct_io"] = True
    if args.record is not None:
        changes["trace_path"] = args.record
    config = StreamConfig.from_env(**changes)
    model, tok = load(
        args.model,
        pack_path=args.pack,
        arena_bytes=args.arena,
        config=config,
        experts="cpu",
        progress=False,
    )
    engine = model.strata_engine
    if args.route_trace:
        from strata_stream.trace.routing import route_by_trace

        route_by_trace(model, QWEN3_TRACE)
    for _ in stream_generate(model, tok, "w1 w2 w3", max_tokens=2):  # warm up
        pass
    mx.random.seed(0)
    sampler = make_sampler(temp=1.0)
    first: dict[str, Any] | None = None
    last: Any = None
    for i, r in enumerate(
        stream_generate(model, tok, _PROMPT, max_tokens=args.tokens, sampler=sampler)
    ):
        if i == 0:
            first = dict(engine.window.stats()["total"])
        last = r
    assert last is not None and first is not None
    end = engine.window.stats()["total"]
    hits = int(end["hits"]) - int(first["hits"])
    misses = int(end["misses"]) - int(first["misses"])
    row = {
        "decode_tps": float(last.generation_tps),
        "hit_rate": hits / (hits + misses) if hits + misses else 1.0,
        "slots": engine.stream.n_slots,
        "direct_io": engine.stream.direct_io,
    }
    engine.close()
    return row


def _child(
    model: Path, pack: Path, arena: int, route: bool, direct: bool, tokens: int, record: Path | None
) -> dict[str, Any]:
    cmd = [
        sys.executable,
        __file__,
        "--one",
        "--model",
        str(model),
        "--pack",
        str(pack),
        "--arena",
        str(arena),
        "--tokens",
        str(tokens),
    ]
    if route:
        cmd.append("--route-trace")
    if direct:
        cmd.append("--direct")
    if record is not None:
        cmd += ["--record", str(record)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _error(measured: float, low: float, high: float) -> float:
    """measured / the nearest end of [low, high]: 1.0 inside it."""
    if measured < low:
        return measured / low
    if measured > high:
        return measured / high
    return 1.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shares", type=float, nargs="+", default=[0.25, 0.5])
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--pack", help=argparse.SUPPRESS)
    ap.add_argument("--arena", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--route-trace", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--direct", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--record", help=argparse.SUPPRESS)
    ap.add_argument(
        "--summarize",
        type=Path,
        metavar="JSON",
        help="print the table again from a --json of an earlier run (its models still in place)",
    )
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args)))
        return 0
    if args.summarize is not None:
        from strata_stream.doctor.saved import load_result

        saved = load_result()
        if saved is None:
            print("no doctor measurement saved: run `strata-stream doctor` first", file=sys.stderr)
            return 2
        summarize(json.loads(args.summarize.read_text()), saved)
        return 0

    from strata_stream.convert import convert
    from strata_stream.doctor.saved import load_result
    from strata_stream.mlx_lm.random_model import make_checkpoint
    from strata_stream.pack.reader import ExpertPack

    doctor = load_result()
    if doctor is None:
        print("no doctor measurement saved: run `strata-stream doctor` first", file=sys.stderr)
        return 2
    print(
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; doctor of {doctor.path}"
    )
    work = Path(tempfile.mkdtemp(prefix="plan-accuracy-"))
    built: dict[str, tuple[Path, Path]] = {}
    for name in args.models:
        dims, _, _ = MODELS[name]
        base = name.removesuffix("-direct")
        if base not in built:
            model_dir = make_checkpoint("qwen3_moe", work / base, dims=dims or None)
            built[base] = (model_dir, convert(model_dir, work / f"{base}.strpk", progress=False))
    # (model, share) -> runs; share 1.0: every expert resident
    configs = [(n, s) for n in args.models for s in (1.0, *args.shares)]
    runs: dict[tuple[str, float], list[dict[str, Any]]] = {c: [] for c in configs}
    arenas: dict[tuple[str, float], int] = {}
    for name, share in configs:
        _, pack = built[name.removesuffix("-direct")]
        with ExpertPack.open(pack) as pk:
            g, stride = pk.geometry, pk.record_stride
        arenas[(name, share)] = max(2 * g.top_k, round(share * g.n_records)) * stride
    for name in args.models:  # the recorded traces: one unmeasured run each (recording costs)
        model_dir, pack = built[name.removesuffix("-direct")]
        _, route, direct = MODELS[name]
        _child(
            model_dir,
            pack,
            arenas[(name, 1.0)],
            route,
            direct,
            args.tokens,
            work / f"{name}.trace.csv",
        )
    for rep in range(args.repeats):
        for name, share in configs:
            model_dir, pack = built[name.removesuffix("-direct")]
            _, route, direct = MODELS[name]
            runs[(name, share)].append(
                _child(model_dir, pack, arenas[(name, share)], route, direct, args.tokens, None)
            )
            tps = runs[(name, share)][-1]["decode_tps"]
            print(f"  repeat {rep + 1}: {name} share {share}: {tps:.1f} tok/s", file=sys.stderr)

    state = {
        "work": str(work),
        "built": {k: [str(a), str(b)] for k, (a, b) in built.items()},
        "configs": configs,
        "arenas": {f"{n}@{s}": a for (n, s), a in arenas.items()},
        "runs": {f"{n}@{s}": r for (n, s), r in runs.items()},
    }
    if args.json:  # the runs first: a failure in the summary keeps them (--summarize)
        args.json.write_text(json.dumps(state, indent=1) + "\n")
    rows = summarize(state, doctor)
    if args.json:
        args.json.write_text(json.dumps({**state, "rows": rows}, indent=1) + "\n")
    return 0


def summarize(state: dict[str, Any], doctor: Any) -> list[dict[str, Any]]:
    """plan's three predictions for every run, the table and the error bands."""
    from strata_stream.config import DEFAULT_IO_THREADS
    from strata_stream.pack.reader import ExpertPack
    from strata_stream.plan import make_plan
    from strata_stream.plan.hit_rate import REFERENCE_TRACE

    work = Path(state["work"])
    built = {k: (Path(a), Path(b)) for k, (a, b) in state["built"].items()}
    configs = [(n, float(s)) for n, s in state["configs"]]
    arenas = {(n, s): state["arenas"][f"{n}@{s}"] for n, s in configs}
    runs = {(n, s): state["runs"][f"{n}@{s}"] for n, s in configs}
    rows = []
    for name, share in configs:
        model_dir, _ = built[name.removesuffix("-direct")]
        _, route, direct = MODELS[name]
        tps = [r["decode_tps"] for r in runs[(name, share)]]
        resident = [r["decode_tps"] for r in runs[(name, 1.0)]]
        own_trace = REFERENCE_TRACE if route else work / f"{name}.trace.csv"
        disk = None
        if direct:  # the run forced direct reads, which plan would not choose for this pack
            with ExpertPack.open(built[name.removesuffix("-direct")][1]) as pk:
                stride = pk.record_stride
            reading = doctor.disk_gbps("direct", stride, DEFAULT_IO_THREADS)
            disk = None if reading is None else reading.gbps
        arena = arenas[(name, share)]
        row: dict[str, Any] = {
            "model": name,
            "share": share,
            "slots": runs[(name, share)][0]["slots"],
            "measured_hit": statistics.median(r["hit_rate"] for r in runs[(name, share)]),
            # The median, and the best run: the one the machine's load disturbed least.
            "measured_tps": {"median": statistics.median(tps), "best": max(tps)},
        }
        for how, trace in (("default", None), ("trace", own_trace)):
            p = make_plan(str(model_dir), arena=arena, doctor=doctor, disk_gbps=disk, trace=trace)
            assert p.hit is not None and p.speed is not None
            row[how] = {
                "hit": p.hit.hit_rate,
                "low": p.speed.low,
                "high": p.speed.high,
                "read_source": p.read.source if p.read else None,
            }
        for stat in ("median", "best"):
            compute = statistics.median(resident) if stat == "median" else max(resident)
            p = make_plan(
                str(model_dir),
                arena=arena,
                doctor=doctor,
                disk_gbps=disk,
                trace=own_trace,
                compute_tps=compute,
            )
            assert p.speed is not None
            row[f"measured compute ({stat})"] = {"low": p.speed.low, "high": p.speed.high}
        for how in ("default", "trace"):
            row[how]["error"] = {
                stat: _error(row["measured_tps"][stat], row[how]["low"], row[how]["high"])
                for stat in ("median", "best")
            }
        for stat in ("median", "best"):
            m = row[f"measured compute ({stat})"]
            m["error"] = _error(row["measured_tps"][stat], m["low"], m["high"])
        rows.append(row)

    print(
        f"\n{'model':<14} {'share':>5} {'slots':>5} | {'hit':>6} {'plan':>6} {'trace':>6} | "
        f"{'tok/s med':>9} {'best':>7} | {'default range':>18} {'err':>5} | "
        f"{'measured-compute range (best)':>29} {'err':>5} | {'(median)':>8}"
    )
    for r in rows:
        d, t, b = r["default"], r["trace"], r["measured compute (best)"]
        med = r["measured compute (median)"]
        print(
            f"{r['model']:<14} {r['share']:>5.2f} {r['slots']:>5} | {r['measured_hit']:>6.3f} "
            f"{d['hit']:>6.3f} {t['hit']:>6.3f} | {r['measured_tps']['median']:>9.1f} "
            f"{r['measured_tps']['best']:>7.1f} | {d['low']:>8.0f}..{d['high']:<8.0f} "
            f"{d['error']['best']:>5.2f} | {b['low']:>13.1f}..{b['high']:<14.1f} "
            f"{b['error']:>5.2f} | {med['error']:>8.2f}"
        )
    streamed = [r for r in rows if r["share"] < 1.0]
    for how in ("default", "trace"):
        hit = [r[how]["hit"] - r["measured_hit"] for r in streamed]
        print(f"hit rate, {how} trace: predicted - measured {min(hit):+.3f}..{max(hit):+.3f}")
    for stat in ("best", "median"):
        d = [r["default"]["error"][stat] for r in streamed]
        m = [r[f"measured compute ({stat})"]["error"] for r in streamed]
        print(
            f"tok/s ({stat} run), measured / nearest end of the range: default "
            f"{min(d):.3f}..{max(d):.3f}; with the measured compute ceiling "
            f"{min(m):.2f}..{max(m):.2f}"
        )
    return rows


if __name__ == "__main__":
    sys.exit(main())
