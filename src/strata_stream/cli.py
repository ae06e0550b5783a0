"""The `strata-stream` command: pack, convert, inspect and verify packs; demo, generate, serve;
plan and doctor."""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from strata_stream.config import EVICTION_POLICIES
from strata_stream.errors import CheckpointError, ConfigError, PackError, StrataError
from strata_stream.paths import model_location


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
    conv.add_argument("model", metavar="MODEL",
                      help="checkpoint directory (safetensors) or Hugging Face repo")  # fmt: skip
    conv.add_argument("-o", "--out", metavar="PACK",
                      help="pack file to write (default: the cache, where generate, serve and "
                      "load find it); an existing file is replaced only if it is a "
                      "pack")  # fmt: skip
    conv.add_argument("--force", action="store_true",
                      help="let -o replace a file that is not a pack")  # fmt: skip
    conv.add_argument("--quiet", action="store_true", help="no progress bar")
    conv.add_argument("--quantize", choices=("q4", "q8"), default=None,
                      help="quantize float (f32/f16/bf16) experts to 4 or 8 bits on the way "
                      "(lossy: the pack holds the quantized weights)")  # fmt: skip
    conv.add_argument("--group-size", type=int, choices=(32, 64, 128), default=None,
                      help="quantization group size with --quantize (default 64)")  # fmt: skip

    gen = sub.add_parser(
        "generate", help="generate text with a model whose experts stream from SSD"
    )
    gen.add_argument("model", metavar="MODEL", help="model directory or Hugging Face repo")
    gen.add_argument("--engine", choices=ENGINES, default=None, help=_ENGINE_HELP)
    gen.add_argument("--device", default=None, help=_DEVICE_HELP)
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--max-tokens", type=int, default=None,
                     help="tokens to generate, at least 1 (default 100, less if the context "
                     "ends first)")  # fmt: skip
    gen.add_argument(
        "--arena-gb", default=None, metavar="SIZE",
        help="expert memory: GiB, or a size with its unit such as 512MiB or 8GB (default: from "
        "free RAM)",
    )  # fmt: skip
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
    serve.add_argument("model", metavar="MODEL",
                       help="model directory (mlx-lm's layout, or a Hugging Face checkpoint "
                       "with --engine transformers) or Hugging Face repo")  # fmt: skip
    serve.add_argument("--engine", choices=ENGINES, default=None, help=_ENGINE_HELP)
    serve.add_argument("--device", default=None, help=_DEVICE_HELP)
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    serve.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 = any)")
    serve.add_argument("--arena-gb", metavar="SIZE",
                       help="expert arena size: GiB, or a size with its unit such as 512MiB or "
                       "8GB")  # fmt: skip
    spar = serve.add_mutually_exclusive_group()
    spar.add_argument("--pipeline", action="store_true",
                      help="under mlx.launch: ranks split the layers; rank 0 serves")
    spar.add_argument("--tensor", action="store_true",
                      help="under mlx.launch: ranks split every expert; rank 0 serves")
    serve.add_argument("--experts", choices=("cpu", "mlx"), default="cpu",
                       help="who computes the experts with --pipeline/--tensor (default cpu)")
    serve.add_argument("--pack", default=None,
                       help="the model's pack, e.g. one `convert -o` wrote (default: the cache's, "
                       "converted once)")  # fmt: skip
    serve.add_argument("--model-id", help="model name clients use (default: MODEL's basename)")
    serve.add_argument(
        "--max-queue",
        type=int,
        # ServeConfig.max_queue's default, not imported: the server's package needs FastAPI,
        # which generate does not (test_cli checks the two agree).
        default=64,
        help="waiting requests before 503 (default 64; a request takes one place, whatever "
        "its prompt count)",
    )
    serve.add_argument("--max-batch", type=int, default=None,
                       help="requests generated together (default 8)")
    serve.add_argument("--prefill-chunk", type=int, default=512, metavar="TOKENS",
                       help="prompt tokens prefilled between decode steps (default 512)")
    serve.add_argument("--prompt-cache-dir", metavar="DIR", default=None,
                       help="keep prompt caches in DIR across restarts (default: memory "
                       "only)")  # fmt: skip
    serve.add_argument("--prompt-cache-gb", metavar="SIZE", default="8",
                       help="prompt cache files kept in --prompt-cache-dir: GiB, or a size with "
                       "its unit (default 8; least recently used removed first)")  # fmt: skip
    serve.add_argument("--prompt-cache-memory-gb", metavar="SIZE", default="1",
                       help="prompt caches kept in memory across requests: GiB, or a size with "
                       "its unit (default 1; 0: none)")  # fmt: skip

    plan = sub.add_parser(
        "plan",
        help="will a model run here, in how much memory, how fast: from its config and "
        "checkpoint headers, nothing downloaded",
    )
    plan.add_argument("model", metavar="MODEL",
                      help="model directory or Hugging Face repo (read: config.json and the "
                      "safetensors headers)")  # fmt: skip
    plan.add_argument("--memory", metavar="SIZE",
                      help="memory the process can have, e.g. 24GB (binary units; default: "
                      "what is available here now)")  # fmt: skip
    plan.add_argument("--arena-gb", metavar="SIZE",
                      help="plan this arena instead of the one the memory gives: GiB, or a "
                      "size with its unit")  # fmt: skip
    plan.add_argument("--disk-gbps", type=float, metavar="X",
                      help="the pack disk's read rate in GB/s (default: doctor's last "
                      "measurement, else an assumed figure, and plan says so)")  # fmt: skip
    plan.add_argument("--compute-tps", type=float, metavar="X",
                      help="the model's decode tokens/s with every expert resident, if known "
                      "(default: estimated from the bytes a token reads)")  # fmt: skip
    plan.add_argument("--trace", metavar="FILE",
                      help="a routing trace to replay (route_trace or strata_trace v1; default: "
                      "one recorded beside the model's cached pack, else the shipped Qwen3 "
                      "trace)")  # fmt: skip
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")

    doctor = sub.add_parser(
        "doctor", help="measure this machine: memory the process can have, the disk's read rate"
    )
    doctor.add_argument("--path", metavar="DIR",
                        help="a folder on the disk packs are read from (default: the cache, "
                        "where converted packs live)")  # fmt: skip
    doctor.add_argument("--json", action="store_true", help="print the results as JSON")
    doctor.add_argument("--quiet", action="store_true", help="no progress bar")

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
    from strata_stream.convert import check_output, convert
    from strata_stream.convert.pack_cache import ensure_pack
    from strata_stream.paths import model_dir

    if args.out is None and args.quantize is not None:
        raise ConfigError("--quantize needs -o PACK: the cache holds the checkpoint's own "
                          "experts")  # fmt: skip
    if args.group_size is not None and args.quantize is None:
        raise ConfigError("--group-size applies to --quantize only: add --quantize q4 or q8, or "
                          "leave it out (a quantized checkpoint keeps its own groups)")  # fmt: skip
    if args.out is None and args.force:
        raise ConfigError("--force applies to -o PACK only: the cache is replaced only when it "
                          "is out of date")  # fmt: skip
    if args.out is not None:  # a bad -o fails before anything is fetched or read
        check_output(args.out, args.force)
    # A repo id is fetched as load() fetches it, so the pack lands in the entry load() finds.
    model = model_dir(args.model)
    if args.out is None:  # into the cache entry load() uses; kept if it is up to date
        path = ensure_pack(model, progress=not args.quiet)
        print(f"{path} ({path.stat().st_size:,} bytes): generate, serve and load use it")
        return 0
    path = convert(model, args.out, progress=not args.quiet, quantize=args.quantize,
                   group_size=args.group_size or 64, force=args.force)  # fmt: skip
    print(f"wrote {path} ({path.stat().st_size:,} bytes); use it with --pack {path}")
    return 0


def _cache_gib(text: str, flag: str) -> float:
    """A prompt cache size as GiB >= 0: a bare number is GiB, else a size with its unit."""
    try:
        gib = float(text)
    except ValueError:
        from strata_stream.config import parse_size

        gib = parse_size(text, flag) / (1 << 30)
    if not (math.isfinite(gib) and gib >= 0):
        raise ConfigError(f"{flag} must be a size >= 0, got {text}")
    return gib


def _arena_gib(text: str | None) -> float | None:
    """--arena-gb as GiB: a bare number is GiB (the flag's unit), else a size with its unit."""
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        pass
    from strata_stream.config import parse_size

    return parse_size(text, "--arena-gb") / (1 << 30)


def _check_arena_gb(arena_gb: float | None) -> None:
    if arena_gb is not None and not (math.isfinite(arena_gb) and arena_gb > 0):
        raise ConfigError(f"--arena-gb must be a number of GiB > 0, got {arena_gb}")


def _check_generate(args: argparse.Namespace) -> None:
    """The mistakes a generation would only find after loading the model (or never)."""
    if not args.prompt.strip():
        raise ConfigError("--prompt is empty")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ConfigError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    _check_arena_gb(args.arena_gb)
    model_location(args.model)


ENGINES = ("mlx-lm", "transformers")
_ENGINE_HELP = ("who runs the model's dense layers: mlx-lm or transformers (Hugging Face, torch). "
                "Without --engine: mlx-lm where mlx-lm is installed, else transformers")
_DEVICE_HELP = ("--engine transformers: the torch device of the dense layers and the experts, "
                "cpu (default) or cuda[:N]")
_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def _check_device(args: argparse.Namespace, engine: str) -> None:
    if args.device is None:
        return
    if engine != "transformers":
        raise ConfigError(f"--device is for --engine transformers (the engine is {engine}: "
                          "add --engine transformers)")  # fmt: skip
    if not _DEVICE.fullmatch(args.device):
        raise ConfigError(f"--device must be cpu, cuda or cuda:N, got {args.device!r}")


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _default_engine() -> str:
    return "mlx-lm" if _has("mlx_lm") else "transformers"


def _generate(args: argparse.Namespace) -> int:
    _check_generate(args)
    engine = args.engine or _default_engine()
    _check_device(args, engine)
    if engine == "transformers":
        return _generate_transformers(args)
    try:
        from strata_stream.mlx_lm.generate_cli import generate
    except ImportError as e:
        print(f"strata-stream: error: generate needs mlx and mlx-lm ({e}): "
              f"{_install('mlx')}", file=sys.stderr)  # fmt: skip
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
    try:
        generate(args.model, args.prompt, max_tokens=args.max_tokens, arena_gb=args.arena_gb,
                 experts=args.experts, arithmetic=args.arithmetic, pack_path=args.pack)  # fmt: skip
    except CheckpointError as e:
        # Without --engine, a checkpoint mlx-lm cannot read runs with the engine that can.
        if args.engine is not None or e.engine != "transformers" or not _has("transformers"):
            raise
        print(f"strata-stream: {' '.join(str(e).split())}; running it with --engine "
              "transformers", file=sys.stderr)  # fmt: skip
        return _generate_transformers(args)
    return 0


def _generate_transformers(args: argparse.Namespace) -> int:
    if args.pipeline or args.tensor or args.experts != "cpu" or args.arithmetic != "auto":
        raise ConfigError("--pipeline, --tensor, --experts and --arithmetic are for --engine "
                          "mlx-lm")  # fmt: skip
    try:
        from strata_stream.transformers.generate_cli import generate
    except ImportError as e:
        print(f"strata-stream: error: --engine transformers needs torch and transformers ({e}): "
              f"{_install('transformers')}", file=sys.stderr)  # fmt: skip
        return 2
    generate(args.model, args.prompt, max_tokens=args.max_tokens or 100,
             arena_gb=args.arena_gb, pack_path=args.pack, device=args.device)  # fmt: skip
    return 0


def _install(extra: str) -> str:
    """How to install an extra: from a clone, since the package is not on PyPI."""
    return f'pip install ".[{extra}]" in a clone of strata-stream (it is not on PyPI yet)'


# What `serve` imports beyond the base install, and the extra (one per engine) that has it.
_SERVE_MODULES = {
    "mlx-lm": ("fastapi", "uvicorn", "prometheus_client", "mlx", "mlx_lm", "transformers"),
    "transformers": ("fastapi", "uvicorn", "prometheus_client", "torch", "transformers"),
}
_SERVE_EXTRAS = {"mlx-lm": "mlx", "transformers": "transformers"}


def _serve(args: argparse.Namespace) -> int:
    import importlib.util

    engine = args.engine or _default_engine()
    missing = [m for m in _SERVE_MODULES[engine] if importlib.util.find_spec(m) is None]
    if missing:
        print(f"strata-stream: error: serve needs {', '.join(missing)} (engine {engine}): "
              f"{_install(_SERVE_EXTRAS[engine])}", file=sys.stderr)  # fmt: skip
        return 2
    _check_arena_gb(args.arena_gb)
    _check_device(args, engine)
    # The server's own checks name its config's fields; a CLI user typed these flags.
    for flag, value in (("--max-queue", args.max_queue), ("--max-batch", args.max_batch),
                        ("--prefill-chunk", args.prefill_chunk)):  # fmt: skip
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be at least 1, got {value}")
    cache_gib = _cache_gib(args.prompt_cache_gb, "--prompt-cache-gb")
    memory_gib = _cache_gib(args.prompt_cache_memory_gb, "--prompt-cache-memory-gb")
    model_location(args.model)
    distributed = "pipeline" if args.pipeline else "tensor" if args.tensor else None
    if distributed is not None and args.pack is not None:
        raise ConfigError("--pack names one pack; with --pipeline/--tensor each rank converts "
                          "or finds its own share")  # fmt: skip
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
        distributed=distributed,
        experts=args.experts,
        pack_path=args.pack,
        engine=engine,
        device=args.device,
        prompt_cache_dir=args.prompt_cache_dir,
        prompt_cache_gb=cache_gib,
        prompt_cache_memory_gb=memory_gib,
    )
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from strata_stream.pack.header import MATRICES, ROLES
    from strata_stream.pack.reader import ExpertPack
    from strata_stream.units import human_bytes

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
            f"file size      {pack.file_bytes:,} bytes ({human_bytes(pack.file_bytes)})",
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


def _positive(flag: str, value: float | None) -> None:
    if value is not None and not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{flag} must be a number > 0, got {value}")


def _plan(args: argparse.Namespace) -> int:
    import json

    from strata_stream.config import parse_size
    from strata_stream.plan import format_plan, make_plan

    _check_arena_gb(args.arena_gb)
    _positive("--disk-gbps", args.disk_gbps)
    _positive("--compute-tps", args.compute_tps)
    memory = None if args.memory is None else parse_size(args.memory, "--memory")
    if memory is not None and memory <= 0:
        raise ConfigError(f"--memory must be a size > 0, got {args.memory!r}")
    if memory is not None and args.arena_gb is not None:
        raise ConfigError("--memory and --arena-gb both size the arena: give one")
    if args.trace is not None and not Path(args.trace).is_file():
        raise ConfigError(f"--trace {args.trace}: no such file")
    arena = None if args.arena_gb is None else int(args.arena_gb * (1 << 30))
    p = make_plan(args.model, memory=memory, arena=arena, disk_gbps=args.disk_gbps,
                  compute_tps=args.compute_tps, trace=args.trace)  # fmt: skip
    print(json.dumps(p.to_json(), indent=1) if args.json else format_plan(p))
    return 0


def _doctor(args: argparse.Namespace) -> int:
    import json

    from strata_stream.doctor.report import format_doctor, run_doctor

    result, saved = run_doctor(args.path, progress=not args.quiet and not args.json)
    if args.json:
        print(json.dumps({**result.to_json(), "saved": str(saved)}, indent=1))
    else:
        print(format_doctor(result, saved))
    return 0


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
        if hasattr(args, "arena_gb"):
            args.arena_gb = _arena_gib(args.arena_gb)
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
            return _serve(args)
        if args.command == "plan":
            return _plan(args)
        if args.command == "doctor":
            return _doctor(args)
        return _demo(rest)
    except (StrataError, OSError, ImportError) as e:  # ImportError: an extension not built
        # One line, whatever the message (a library's may run over several).
        print(f"strata-stream: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("strata-stream: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
