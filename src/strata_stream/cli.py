"""The `strata-stream` command: pack, convert, inspect and verify packs; demo, generate, serve."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from strata_stream.config import EVICTION_POLICIES
from strata_stream.errors import PackError, StrataError


def _build_parser() -> argparse.ArgumentParser:
    # Imported here so `strata-stream --help` stays fast and free of numpy import errors.
    from strata_stream.pack.header import WEIGHT_FORMATS
    from strata_stream.pack.presets import PRESETS

    parser = argparse.ArgumentParser(
        prog="strata-stream",
        description="Stream mixture-of-experts expert weights from an SSD pack file.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    pack = sub.add_parser("pack", help="write a pack file")
    source = pack.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--synthetic",
        metavar="PRESET",
        choices=list(PRESETS),
        help=f"random weights with a preset geometry: {', '.join(PRESETS)}",
    )
    pack.add_argument("out", metavar="OUT", help="pack file to write")
    pack.add_argument(
        "--format",
        choices=WEIGHT_FORMATS,
        default=None,
        help="weight format (default: the preset's)",
    )
    pack.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    pack.add_argument("--quiet", action="store_true", help="no progress bar")

    conv = sub.add_parser(
        "convert", help="pack the routed experts of an mlx-lm / Hugging Face checkpoint"
    )
    conv.add_argument("model", metavar="MODEL_DIR", help="checkpoint directory (safetensors)")
    conv.add_argument("-o", "--out", required=True, metavar="PACK", help="pack file to write")
    conv.add_argument("--quiet", action="store_true", help="no progress bar")

    gen = sub.add_parser(
        "generate", help="generate text with an mlx-lm model whose experts stream from SSD"
    )
    gen.add_argument("model", metavar="MODEL", help="mlx-lm model directory or Hugging Face repo")
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--max-tokens", type=int, default=100, help="tokens to generate (100)")
    gen.add_argument(
        "--arena-gb", type=float, default=None, help="expert memory in GiB (default: from free RAM)"
    )
    gen.add_argument("--experts", choices=("cpu", "mlx"), default="cpu",
                     help="who computes the experts (default cpu)")  # fmt: skip
    gen.add_argument("--arithmetic", choices=("auto", "mlx", "float32"), default="auto",
                     help="CPU experts: auto/mlx give mlx-lm's own numbers bitwise; float32 "
                     "rounds once (faster)")  # fmt: skip
    gen.add_argument("--pack", default=None, help="the model's pack (default: converted once)")
    par = gen.add_mutually_exclusive_group()
    par.add_argument("--pipeline", action="store_true",
                     help="under mlx.launch: each rank runs and streams a range of layers")
    par.add_argument("--tensor", action="store_true",
                     help="under mlx.launch: each rank holds and streams a slice of every "
                     "expert")  # fmt: skip

    inspect = sub.add_parser("inspect", help="print a pack's geometry, format and layout")
    inspect.add_argument("pack", metavar="PACK")

    verify = sub.add_parser("verify", help="check every record checksum of a pack")
    verify.add_argument("pack", metavar="PACK")
    verify.add_argument("--quiet", action="store_true", help="no progress bar")

    replay = sub.add_parser(
        "replay",
        help="replay a routing trace through the residency engine; hit rate vs LRU and Belady",
    )
    replay.add_argument("trace", metavar="TRACE", help="route_trace v1 or strata_trace v1 CSV")
    replay.add_argument("--slots", type=int, required=True, help="arena size in expert slots")
    replay.add_argument(
        "--policy",
        default="decayed_lfu",
        choices=EVICTION_POLICIES,
        help="eviction policy (default decayed_lfu)",
    )
    replay.add_argument(
        "--predict-recall",
        type=float,
        metavar="R",
        help="also prefetch modelled next-layer predictions of this recall (e.g. 0.89)",
    )
    replay.add_argument("--json", metavar="OUT", help="write hit_rate, lru_hit_rate, ...")

    serve = sub.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API with /metrics"
    )
    serve.add_argument("model", metavar="MODEL", help="model directory (mlx-lm layout)")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    serve.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 = any)")
    serve.add_argument("--arena-gb", type=float, metavar="G", help="expert arena size in GiB")
    spar = serve.add_mutually_exclusive_group()
    spar.add_argument("--pipeline", action="store_true",
                      help="under mlx.launch: ranks split the layers; rank 0 serves")
    spar.add_argument("--tensor", action="store_true",
                      help="under mlx.launch: ranks split every expert; rank 0 serves")
    serve.add_argument("--experts", choices=("cpu", "mlx"), default="cpu",
                       help="who computes the experts with --pipeline/--tensor (default cpu)")
    serve.add_argument("--model-id", help="model name clients use (default: MODEL's basename)")
    serve.add_argument(
        "--max-queue", type=int, default=8, help="waiting requests before 503 (default 8)"
    )
    serve.add_argument(
        "--max-batch", type=int, default=8, help="requests generated together (default 8)"
    )
    serve.add_argument("--prefill-chunk", type=int, default=512, metavar="TOKENS",
                       help="prompt tokens prefilled between decode steps (default 512)")

    # add_help=False: `demo --help` and every other option belong to the demo's own parser.
    sub.add_parser(
        "demo",
        help="generate with a random-weight mlx-lm model, streamed and plain (demo --help); "
        "demo --synthetic streams the synthetic driver instead",
        add_help=False,
    )
    return parser


def _pack(args: argparse.Namespace) -> int:
    from strata_stream.pack.presets import pack_preset

    path = pack_preset(
        args.synthetic,
        args.out,
        weight_format=args.format,
        seed=args.seed,
        progress=not args.quiet,
    )
    print(f"wrote {path} ({path.stat().st_size:,} bytes)")
    return 0


def _convert(args: argparse.Namespace) -> int:
    from strata_stream.convert import convert

    path = convert(args.model, args.out, progress=not args.quiet)
    print(f"wrote {path} ({path.stat().st_size:,} bytes)")
    return 0


def _generate(args: argparse.Namespace) -> int:
    try:
        from strata_stream.mlx_lm.generate_cli import generate
    except ImportError as e:
        print(f"strata-stream: error: generate needs mlx and mlx-lm ({e}); "
              "pip install 'strata-stream[mlx]'", file=sys.stderr)  # fmt: skip
        return 2
    if args.pipeline or args.tensor:
        if args.pack is not None:
            print("strata-stream: error: --pack names one pack; with --pipeline/--tensor each "
                  "rank converts or finds its own share", file=sys.stderr)  # fmt: skip
            return 2
        from strata_stream.mlx_lm.generate_cli import generate_distributed

        generate_distributed(args.model, args.prompt, mode="pipeline" if args.pipeline else
                             "tensor", max_tokens=args.max_tokens, arena_gb=args.arena_gb,
                             experts=args.experts, arithmetic=args.arithmetic)  # fmt: skip
        return 0
    generate(args.model, args.prompt, max_tokens=args.max_tokens, arena_gb=args.arena_gb,
             experts=args.experts, arithmetic=args.arithmetic, pack_path=args.pack)  # fmt: skip
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from strata_stream.pack.header import MATRICES, ROLES
    from strata_stream.pack.reader import ExpertPack

    with ExpertPack.open(args.pack) as pack:
        g = pack.geometry
        meta = pack.metadata
        quant = (
            f", group_size {pack.group_size}, scales {pack.scale_dtype}" if pack.group_size else ""
        )
        lines = [
            f"pack           {pack.path}",
            f"architecture   {meta['architecture']}",
            f"source         {meta['source']}",
            f"geometry       {g.n_layers} layers x {g.n_experts} experts, top-{g.top_k}, "
            f"hidden {g.hidden}, moe_intermediate {g.moe_intermediate}",
            f"routing        {g.routing}, norm_topk_prob {str(g.norm_topk_prob).lower()}",
            f"activation     {g.activation}"
            + (f" (alpha {g.act_alpha:g}, limit {g.act_limit:g})" if g.act_alpha else "")
            + (f", expert biases {pack.bias_dtype}" if pack.bias_dtype else ""),
            f"weight format  {pack.weight_format}{quant}",
            f"records        {pack.n_records:,} x {pack.record_bytes:,} bytes "
            f"(stride {pack.record_stride:,}) at offset {pack.records_offset:,}",
            f"routers        {pack.header.router_bytes:,} bytes at offset "
            f"{pack.header.router_offset:,}",
            f"file size      {pack.file_bytes:,} bytes ({_human(pack.file_bytes)})",
            *(
                [f"decoder layers {meta['model'].get('decoder_layers')}"]
                if isinstance(meta.get("model"), dict)
                else []
            ),
            "record layout",
        ]
        for t in pack.tensors:
            lines.append(
                f"  {MATRICES[t.matrix]:<4} {ROLES[t.role]:<7} {t.dtype:<4} "
                f"[{t.rows}, {t.cols}]  +{t.offset:,} ({t.nbytes:,} bytes)"
            )
    print("\n".join(lines))
    return 0


def _human(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def _verify(args: argparse.Namespace) -> int:
    from strata_stream.pack.reader import ExpertPack

    with ExpertPack.open(args.pack) as pack:
        try:
            n = pack.verify(progress=not args.quiet)
        except PackError as e:
            # The file opened fine but its data is corrupt: exit 1, distinct from "cannot read".
            print(f"strata-stream: verify failed: {e}", file=sys.stderr)
            return 1
    print(f"ok: {n} records")
    return 0


def _demo(rest: list[str]) -> int:
    if "--synthetic" not in rest:  # a real mlx-lm generation with streamed experts
        try:
            from strata_stream.mlx_lm.demo import main as mlx_demo
        except ImportError as e:
            print(f"strata-stream: error: the mlx-lm demo needs mlx and mlx-lm ({e})",
                  file=sys.stderr)  # fmt: skip
            return 2
        return int(mlx_demo(rest))
    rest = [a for a in rest if a != "--synthetic"]
    try:
        from strata_stream.demo import main as demo_main  # type: ignore[import-not-found,unused-ignore]
    except ImportError as e:
        print(f"strata-stream: error: the demo is unavailable: {e}", file=sys.stderr)
        return 2
    return int(demo_main(rest))


def _replay(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from strata_stream.trace.format import read_trace
    from strata_stream.trace.replay import replay

    trace = read_trace(args.trace)
    r = replay(trace, args.slots, args.policy, recall=args.predict_recall)
    print(
        f"{args.trace}: {trace.n_layers} layers x {trace.n_experts} experts, top-{trace.top_k}, "
        f"{r.accesses} accesses, {r.slots} slots"
    )
    print(
        f"hit rate {r.hit_rate:.3f} ({r.policy}, engine)   LRU {r.lru_hit_rate:.3f}   "
        f"Belady {r.belady_hit_rate:.3f}   reads/use {r.reads_per_access:.3f}"
    )
    if r.lru_predicted_hit_rate is not None:
        print(
            f"with modelled next-layer predictions (recall {r.prediction_recall}): the hit rate "
            f"counts prefetched experts; engine LRU under the same predictions "
            f"{r.lru_predicted_hit_rate:.3f} (LRU and Belady above never prefetch)"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dataclasses.asdict(r), f, indent=2)
            f.write("\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `strata-stream`; returns the exit status (2 for errors)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command != "demo" and rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        if args.command == "pack":
            return _pack(args)
        if args.command == "convert":
            return _convert(args)
        if args.command == "generate":
            return _generate(args)
        if args.command == "inspect":
            return _inspect(args)
        if args.command == "verify":
            return _verify(args)
        if args.command == "replay":
            return _replay(args)
        if args.command == "serve":
            from strata_stream.serve.command import serve

            serve(
                args.model,
                host=args.host,
                port=args.port,
                arena_gb=args.arena_gb,
                model_id=args.model_id,
                max_queue=args.max_queue,
                max_batch=args.max_batch,
                prefill_chunk=args.prefill_chunk,
                distributed="pipeline" if args.pipeline else "tensor" if args.tensor else None,
                experts=args.experts,
            )
            return 0
        return _demo(rest)
    except (StrataError, OSError) as e:
        print(f"strata-stream: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("strata-stream: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
