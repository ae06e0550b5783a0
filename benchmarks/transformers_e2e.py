"""End to end: plain transformers against strata_stream.transformers, Qwen3-30B-A3B's shapes.

    python benchmarks/transformers_e2e.py [--layers 2] [--device cpu|cuda] [--json OUT.json]
        [--plot OUT.png] [--fractions 0.5 0.25 0.1] [--prompt-tokens 32] [--tokens 16]

The model: random qwen3_moe weights with Qwen3-30B-A3B's dimensions (hidden 2048, 32 query and
4 key-value heads of 128, moe_intermediate 768, 128 experts, top-8, vocabulary 151936) over
--layers layers (1.2 GB of bfloat16 experts a layer), every layer sparse, in the layout the
Hub's Qwen3 MoE checkpoints have (per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight`).
It is written once into --workdir (default strata_stream.paths.cache_dir()/bench) tensor by
tensor, each safetensors shard's header first and then every tensor as it is drawn, so
building it holds one tensor at a time; it is converted once into the pack cache.

Configurations, each in a fresh subprocess of this script (the hidden --one flag), so that
every one's peak memory is its own (VmHWM) and none inherits another's allocator state:
- plain transformers, `AutoModelForCausalLM.from_pretrained(experts_implementation=...)`
  with `eager` experts (a loop over the experts hit) and `grouped_mm` (its fastest);
- streamed (`strata_stream.transformers.load`) with every expert resident and with arenas
  of each --fractions share of all experts.
On --device cuda the dense layers run on the GPU in both (plain: device_map="cuda"; streamed:
load(device="cuda"), the experts on the CUDA backend); on cpu everything runs on the host.

Each run: a warm-up generation on other tokens of the same lengths (--prompt-tokens of them,
--tokens new: every shape's first call happens there), then
`model.generate` of --tokens tokens after a --prompt-tokens prompt of random ids, sampled at
temperature 1 with a fixed seed (a random model decoding greedily soon repeats one token, and
its routing would stay on a few experts that any arena holds), min_new_tokens so that every
run decodes as many. A streamer stamps each token: prompt tok/s is the prompt over the time to
the first new token, decode tok/s the tokens after the first over the time after it. Hit rate
and GB read per token are the engine's over the decode tokens. Memory: the child's peak RSS
(VmHWM); on cuda torch.cuda.max_memory_allocated over the measured run plus the arena (the
issue's definition, for an arena the CUDA backend allocates itself), and the device memory in
use at the end (cudaMemGetInfo: whatever allocated it) as the cross-check.

The JSON (--json) is rewritten after every configuration (a run cut short keeps what it
measured) and before the plot; --plot needs matplotlib and is skipped with a message where it
is missing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_PLAIN_IMPLS = ("eager", "grouped_mm")
# Qwen3-30B-A3B's config.json, all but the depth (and every layer sparse).
QWEN3_30B_A3B = {
    "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 0,
}  # fmt: skip


# ---- the checkpoint ---------------------------------------------------------------------------


def _tensors(cfg: Any) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """(name, shape, init) of every tensor, shard by shard in order: the dense names and shapes
    are the model's own (its class on the meta device), the fused experts written per expert.
    init: "embed" (std 1), "norm" (1 + 0.1 N), "matrix" (N / sqrt(fan_in))."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    for name, p in model.state_dict().items():
        shape = tuple(int(d) for d in p.shape)
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H] in transformers 5
            prefix = name[: -len("gate_up_proj")]
            e, two_i, h = shape
            for x in range(e):
                for proj in ("gate_proj", "up_proj"):
                    yield f"{prefix}{x}.{proj}.weight", (two_i // 2, h), "matrix"
        elif name.endswith("mlp.experts.down_proj"):  # [E, H, I]
            prefix = name[: -len("down_proj")]
            e, h, i = shape
            for x in range(e):
                yield f"{prefix}{x}.down_proj.weight", (h, i), "matrix"
        elif "norm" in name:
            yield name, shape, "norm"
        else:
            yield name, shape, "embed" if name.endswith("embed_tokens.weight") else "matrix"


class _Draws:
    """Random bfloat16 tensors, fast: one pool of normal draws (made once), each tensor filled
    from it in pieces at pseudo-random offsets and scaled. Drawing every value afresh (torch's
    CPU generator is one thread) would take minutes for tens of GB; the routers, which decide
    what streams, see weights no less random for it."""

    POOL = 1 << 25  # 32 M values, 64 MB

    def __init__(self, seed: int) -> None:
        import torch

        self._torch = torch
        gen = torch.Generator().manual_seed(seed)
        self._pool = torch.randn(2 * self.POOL, generator=gen, dtype=torch.bfloat16)
        self._rng = torch.Generator().manual_seed(seed + 1)

    def __call__(self, shape: tuple[int, ...], init: str) -> Any:
        torch = self._torch
        out = torch.empty(math.prod(shape), dtype=torch.bfloat16)
        for start in range(0, out.numel(), self.POOL):
            n = min(self.POOL, out.numel() - start)
            at = int(torch.randint(0, self.POOL, (1,), generator=self._rng))
            out[start : start + n] = self._pool[at : at + n]
        out = out.view(shape)
        if init == "norm":
            return out.mul_(0.1).add_(1.0)
        return out if init == "embed" else out.mul_(1.0 / math.sqrt(shape[-1]))


def _write_shard(path: Path, entries: list[tuple[str, tuple[int, ...], str]], draw: _Draws) -> None:
    """A safetensors file written tensor by tensor: the header (every tensor's shape and
    offsets) first, then each tensor's bytes as soon as it is drawn."""
    import torch

    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, _ in entries:
        size = math.prod(shape) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape),
                        "data_offsets": [offset, offset + size]}  # fmt: skip
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    partial = path.with_suffix(".partial")
    with open(partial, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for _, shape, init in entries:  # one tensor in memory at a time, written in place
            f.write(draw(shape, init).view(torch.int16).numpy().data)
    partial.rename(path)


def build_checkpoint(path: Path, layers: int, vocab: int, seed: int = 0) -> Path:
    """The random Qwen3-30B-A3B-shaped checkpoint at `path`, written once (`.complete`)."""
    import transformers

    from strata_stream.transformers.random_model import save_tokenizer

    if (path / ".complete").exists():
        return path
    t0 = time.perf_counter()
    print(f"writing {path} ({layers} layers, once)", flush=True)
    path.mkdir(parents=True, exist_ok=True)
    cfg = transformers.Qwen3MoeConfig(**{**QWEN3_30B_A3B, "vocab_size": vocab,
                                          "num_hidden_layers": layers})  # fmt: skip
    cfg.dtype = "bfloat16"
    cfg.architectures = ["Qwen3MoeForCausalLM"]  # as the Hub's checkpoints name it (GGUF needs it)
    cfg.save_pretrained(str(path))
    # The Hub's config.json also names these as older readers (mlx-lm, llama.cpp) expect them.
    written = json.loads((path / "config.json").read_text())
    written.update(num_experts=cfg.num_local_experts, rope_theta=cfg.rope_parameters["rope_theta"])
    (path / "config.json").write_text(json.dumps(written, indent=2))
    save_tokenizer(path)
    shards: dict[str, list[tuple[str, tuple[int, ...], str]]] = {}
    for name, shape, init in _tensors(cfg):
        layer = name.split(".layers.")[1].split(".")[0] if ".layers." in name else None
        key = f"layer{int(layer):03d}" if layer is not None else "dense"
        shards.setdefault(key, []).append((name, shape, init))
    draw = _Draws(seed)
    weight_map: dict[str, str] = {}
    total = 0
    names = sorted(shards)
    for n, key in enumerate(names):
        file = f"model-{n + 1:05d}-of-{len(names):05d}.safetensors"
        _write_shard(path / file, shards[key], draw)
        for name, shape, _ in shards[key]:
            weight_map[name] = file
            total += math.prod(shape) * 2
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (path / ".complete").write_text("")
    print(f"wrote {total / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s", flush=True)
    return path


def pack_for(path: Path) -> Path:
    from strata_stream.convert.pack_cache import ensure_pack

    t0 = time.perf_counter()
    pack = ensure_pack(path, None, progress=False)  # converted once; found at once later
    if time.perf_counter() - t0 > 1:
        print(f"converted into {pack} in {time.perf_counter() - t0:.0f} s", flush=True)
    return pack


# ---- one configuration (a child process) ------------------------------------------------------


def measure_one(
    path: Path, mode: str, fraction: float | None, args: argparse.Namespace
) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    from strata_stream.config import StreamConfig
    from strata_stream.pack import ExpertPack
    from strata_stream.process_memory import memory_status, peak_bytes

    cuda = args.device.startswith("cuda")
    before = memory_status()
    row: dict[str, Any] = {"mode": mode, "arena_fraction": fraction, "device": args.device}
    t_load = time.perf_counter()
    engine = None
    if mode in _PLAIN_IMPLS:
        kwargs: dict[str, Any] = {"dtype": torch.bfloat16, "experts_implementation": mode}
        try:  # straight onto the GPU where this transformers can
            model = AutoModelForCausalLM.from_pretrained(
                path, **kwargs, **({"device_map": args.device} if cuda else {}))
        except (ImportError, ValueError) as e:
            if not cuda:
                raise
            print(f"device_map={args.device}: {e}; loading on the host, then moving", flush=True)
            model = AutoModelForCausalLM.from_pretrained(path, **kwargs).to(args.device)
    else:
        from strata_stream.transformers import load

        assert fraction is not None
        pack = pack_for(path)
        with ExpertPack.open(pack) as pk:
            everything = pk.geometry.n_records * pk.record_stride
            minimum = 2 * pk.geometry.top_k * pk.record_stride
        arena = max(minimum, int(everything * fraction))
        model = load(path, pack_path=pack, arena_bytes=arena, dtype=torch.bfloat16,
                     device=args.device, config=StreamConfig.from_env(),
                     progress=False)  # fmt: skip
        engine = model.strata_engine
        row["arena_bytes"] = int(engine.stream.n_slots * engine.stream.record_stride)
        row["arena_slots"] = int(engine.stream.n_slots)
        row["all_experts_bytes"] = int(everything)
    model.eval()
    row["load_s"] = time.perf_counter() - t_load
    row["dense_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    device = model.device
    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(2, 60, (1, args.prompt_tokens), generator=gen).to(device)
    warm = torch.randint(2, 60, (1, args.prompt_tokens), generator=gen).to(device)

    stamps: list[float] = []
    marks: list[dict[str, Any]] = []

    class Stamps(BaseStreamer):  # type: ignore[misc]
        def put(self, value: Any) -> None:
            if not first_put[0]:  # generate's first call hands it the prompt
                first_put[0] = True
                return
            stamps.append(time.perf_counter())
            if engine is not None and len(stamps) == 1:
                marks.append(dict(engine.window.stats()["total"]))

        def end(self) -> None:
            pass

    first_put = [False]
    sample = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    with torch.no_grad():
        # Warm-up on other tokens at the very lengths measured: the arena's first reads (which
        # are not what an arena costs) and every shape's first-call cost. On the H200 a decode
        # step at a sequence length the process had not run before cost ~80 ms against ~7 ms
        # at one it had (transformers 5.17, torch 2.11, all configurations alike), so a shorter
        # warm-up measured that cost, not the model.
        model.generate(warm, max_new_tokens=args.tokens, min_new_tokens=args.tokens, **sample)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        if engine is not None:
            engine.window.reset_stats()
        torch.manual_seed(args.seed)
        t0 = time.perf_counter()
        model.generate(prompt, max_new_tokens=args.tokens, min_new_tokens=args.tokens,
                       streamer=Stamps(), **sample)  # fmt: skip
        if cuda:
            torch.cuda.synchronize()
        t1 = time.perf_counter()
    n = len(stamps)
    row["prompt_tokens"] = args.prompt_tokens
    row["decode_tokens"] = n
    row["prompt_tokens_per_s"] = args.prompt_tokens / (stamps[0] - t0)
    row["decode_tokens_per_s"] = (n - 1) / (t1 - stamps[0]) if n > 1 else None
    if engine is not None and marks:
        end = engine.window.stats()["total"]
        hits = int(end["hits"]) - int(marks[0]["hits"])
        misses = int(end["misses"]) - int(marks[0]["misses"])
        row["decode_hit_rate"] = hits / (hits + misses) if hits + misses else None
        row["gb_read_per_token"] = (int(end["bytes_read"]) - int(marks[0]["bytes_read"])) / max(
            1, n - 1) / 1e9  # fmt: skip
    if cuda:
        free, total = torch.cuda.mem_get_info()
        row["gpu_torch_peak_bytes"] = int(torch.cuda.max_memory_allocated())
        row["gpu_peak_bytes"] = row["gpu_torch_peak_bytes"] + row.get("arena_bytes", 0)
        row["gpu_in_use_bytes"] = int(total - free)
    row["peak_rss_bytes"] = peak_bytes()
    row["libraries_bytes"] = before.resident if before is not None else None
    if engine is not None:
        engine.close()
    return row


# ---- the parent: every configuration, the table, the JSON and the plot -----------------------


def _label(mode: str, fraction: float | None) -> str:
    if mode in _PLAIN_IMPLS:
        return f"plain transformers ({mode} experts)"
    return "streamed, all resident" if fraction == 1.0 else f"streamed, arena {fraction:.0%}"


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _median(values: list[float]) -> float | None:
    return float(statistics.median(values)) if values else None


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per configuration, in run order: each figure's median over the repeats, and
    the decode tok/s of every repeat (`decode_all`)."""
    keys: list[tuple[str, float | None]] = []
    for r in rows:
        if (r["mode"], r["arena_fraction"]) not in keys:
            keys.append((r["mode"], r["arena_fraction"]))
    out = []
    for mode, frac in keys:
        rs = [r for r in rows if (r["mode"], r["arena_fraction"]) == (mode, frac)]
        med: dict[str, Any] = {"mode": mode, "arena_fraction": frac, "repeats": len(rs)}
        for k in rs[0]:
            values = [r[k] for r in rs if isinstance(r.get(k), (int, float))
                      and not isinstance(r.get(k), bool)]  # fmt: skip
            if values and k not in ("arena_fraction", "repeat"):
                med[k] = _median([float(v) for v in values])
        med["decode_all"] = [r["decode_tokens_per_s"] for r in rs]
        out.append(med)
    return out


def table(rows: list[dict[str, Any]], cuda: bool) -> str:
    head = ("| configuration | prompt tok/s | decode tok/s | decode hit rate | GB read / token "
            "| peak RSS GB | weights in torch GB |")
    rule = "|---|---|---|---|---|---|---|"
    if cuda:
        head += " GPU peak GB (torch + arena) | GPU in use GB |"
        rule += "---|---|"
    lines = [head, rule]
    for r in summary(rows):
        spread = ""
        if r["repeats"] > 1:
            spread = " [" + ", ".join(_fmt(v, ".2f") for v in r["decode_all"]) + "]"
        line = (f"| {_label(r['mode'], r['arena_fraction'])} "
                f"| {_fmt(r.get('prompt_tokens_per_s'), '.1f')} "
                f"| {_fmt(r.get('decode_tokens_per_s'), '.2f')}{spread} "
                f"| {_fmt(r.get('decode_hit_rate'), '.3f')} "
                f"| {_fmt(r.get('gb_read_per_token'), '.3f')} | {r['peak_rss_bytes'] / 1e9:.2f} "
                f"| {r['dense_bytes'] / 1e9:.2f} |")
        if cuda:
            line += (f" {r['gpu_peak_bytes'] / 1e9:.2f} ({r['gpu_torch_peak_bytes'] / 1e9:.2f}"
                     f" + {r.get('arena_bytes', 0) / 1e9:.2f}) "
                     f"| {r['gpu_in_use_bytes'] / 1e9:.2f} |")
        lines.append(line)
    return "\n".join(lines)


def ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Streamed all-resident decode over each plain implementation's, medians over the
    repeats (the issue's target on the H200: >= 1.0)."""
    med = {(r["mode"], r["arena_fraction"]): r.get("decode_tokens_per_s") for r in summary(rows)}
    out = {}
    for impl in _PLAIN_IMPLS:
        s, q = med.get(("streamed", 1.0)), med.get((impl, None))
        if s and q:
            out[impl] = s / q
    return out


def plot(rows: list[dict[str, Any]], out: Path, title: str, cuda: bool) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"--plot {out}: skipped, matplotlib is not installed (the JSON has the rows)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary(rows)  # medians over the repeats
    streamed = sorted((r for r in rows if r["mode"] == "streamed"),
                      key=lambda r: r["arena_fraction"])  # fmt: skip
    plain = [r for r in rows if r["mode"] in _PLAIN_IMPLS]
    panels = [("decode_tokens_per_s", "decode tok/s", 1.0),
              ("prompt_tokens_per_s", "prompt tok/s", 1.0),
              ("peak_rss_bytes", "peak RSS (GB)", 1e-9)]  # fmt: skip
    if cuda:
        panels.append(("gpu_peak_bytes", "GPU peak: torch + arena (GB)", 1e-9))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4.2))
    xs = [r["arena_fraction"] * 100 for r in streamed]
    for ax, (key, name, k) in zip(axes, panels, strict=True):
        ax.plot(xs, [(r.get(key) or 0) * k for r in streamed], "o-", color="C0",
                label=f"streamed ({'CUDA' if cuda else 'CPU'} experts)")  # fmt: skip
        for i, r in enumerate(plain):
            ax.axhline((r.get(key) or 0) * k, color=f"C{3 + i}", ls="--",
                       label=f"plain transformers, {r['mode']}")  # fmt: skip
        ax.set_xlabel("arena (% of all experts)")
        ax.set_ylabel(name)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend(loc="best", fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    print(f"wrote {out}")


def _write_json(args: argparse.Namespace, path: Path, rows: list[dict[str, Any]]) -> None:
    doc = {"model": str(path), "layers": args.layers, "device": args.device,
           "prompt_tokens": args.prompt_tokens, "decode_tokens": args.tokens,
           "repeats": args.repeats, "rows": rows, "summary": summary(rows),
           "streamed_over_plain_decode": ratios(rows)}  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=2) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=2, help="decoder layers (1.2 GB of experts each)")
    p.add_argument("--vocab", type=int, default=QWEN3_30B_A3B["vocab_size"],
                   help="vocabulary size (default Qwen3's 151936)")  # fmt: skip
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--fractions", type=float, nargs="*", default=[0.5, 0.25, 0.1],
                   help="arena sizes below all-resident, as shares of all experts")  # fmt: skip
    p.add_argument("--plain", nargs="*", default=list(_PLAIN_IMPLS), choices=_PLAIN_IMPLS,
                   help="plain transformers experts implementations to run")  # fmt: skip
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--tokens", type=int, default=16, help="decode tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of every configuration, in rotated orders (medians reported)")
    p.add_argument("--workdir", type=Path, default=None,
                   help="where the checkpoint is written (default: the cache's bench/)")
    p.add_argument("--child-timeout", type=float, default=600.0,
                   help="seconds one configuration may take")  # fmt: skip
    p.add_argument("--json", type=Path, help="write the rows here")
    p.add_argument("--plot", type=Path, help="write tok/s and memory vs arena share (PNG)")
    p.add_argument("--one", nargs=2, metavar=("MODE", "FRACTION"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if not (args.device == "cpu" or args.device == "cuda" or args.device.startswith("cuda:")):
        p.error(f"--device must be cpu, cuda or cuda:N, got {args.device!r}")
    if args.layers < 1 or args.tokens < 2 or args.prompt_tokens < 1:
        p.error("--layers >= 1, --tokens >= 2 and --prompt-tokens >= 1")
    if any(not 0 < f < 1 for f in args.fractions):
        p.error("--fractions are shares in (0, 1)")

    from strata_stream.paths import cache_dir

    workdir = args.workdir if args.workdir is not None else cache_dir() / "bench"
    path = workdir / f"hf-qwen3-30b-a3b-shapes-{args.layers}L-v{args.vocab}"
    if args.one is not None:
        mode, frac = args.one
        row = measure_one(path, mode, None if mode in _PLAIN_IMPLS else float(frac), args)
        print("ROW " + json.dumps(row), flush=True)
        return

    build_checkpoint(path, args.layers, args.vocab, args.seed)
    pack_for(path)  # converted once, before any measured child
    configs: list[tuple[str, float | None]] = [(impl, None) for impl in args.plain]
    configs += [("streamed", 1.0)] + [("streamed", f) for f in sorted(args.fractions, reverse=True)]
    rows: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    # Each repeat rotates the order, so no configuration always runs first on a busy machine.
    runs = [(rep, c) for rep in range(args.repeats)
            for c in configs[rep % len(configs):] + configs[: rep % len(configs)]]  # fmt: skip
    for rep, (mode, frac) in runs:
        cmd = [sys.executable, __file__, "--one", mode, str(frac), "--layers", str(args.layers),
               "--vocab", str(args.vocab), "--device", args.device, "--seed", str(args.seed),
               "--prompt-tokens", str(args.prompt_tokens), "--tokens", str(args.tokens),
               "--workdir", str(workdir)]  # fmt: skip
        t0 = time.perf_counter()
        try:
            child = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy(),
                                   timeout=args.child_timeout)  # fmt: skip
        except subprocess.TimeoutExpired:
            print(f"{_label(mode, frac)}: timed out after {args.child_timeout:.0f} s", flush=True)
            continue
        found = [ln for ln in child.stdout.splitlines() if ln.startswith("ROW ")]
        if child.returncode != 0 or not found:
            print(f"{_label(mode, frac)}: failed ({child.returncode}):\n{child.stderr[-3000:]}",
                  flush=True)  # fmt: skip
            continue
        row = json.loads(found[-1][4:])
        row["wall_s"] = time.perf_counter() - t0
        row["repeat"] = rep
        rows.append(row)
        if args.json is not None:  # after every run: a run cut short by a timeout keeps its rows
            _write_json(args, path, rows)
        print(f"{_label(mode, frac):<38} prompt {row['prompt_tokens_per_s']:8.1f} tok/s  decode "
              f"{_fmt(row['decode_tokens_per_s'], '7.2f')} tok/s  peak RSS "
              f"{row['peak_rss_bytes'] / 1e9:.2f} GB  ({row['wall_s']:.0f} s)",
              flush=True)  # fmt: skip
    cuda = args.device.startswith("cuda")
    desc = (f"{path.name} on {args.device}: prompt {args.prompt_tokens} tokens, {args.tokens} "
            f"decode tokens, {args.repeats} repeat(s), "
            f"{time.perf_counter() - t_start:.0f} s")  # fmt: skip
    print(f"\n{desc} (medians; decode tok/s of each repeat in brackets)\n{table(rows, cuda)}")
    r = ratios(rows)
    for impl, x in r.items():
        print(f"streamed all-resident / plain ({impl}) decode: x{x:.2f}")
    if args.json is not None:
        _write_json(args, path, rows)
        print(f"wrote {args.json}")
    if args.plot is not None:
        plot(rows, args.plot, f"transformers end to end, Qwen3-30B-A3B shapes: {desc}", cuda)
    if len(rows) < len(runs):
        sys.exit(f"{len(runs) - len(rows)} of {len(runs)} runs failed")


if __name__ == "__main__":
    main()
