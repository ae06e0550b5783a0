"""strata-stream beside llama.cpp on the same model, memory and disk: the comparison a user with a
model bigger than memory makes, reproducible from a clone (Linux, root).

    python benchmarks/peers/run.py [--workdir DIR] [--layers 12] [--limits none 0.5 0.25]
        [--pairs 3] [--prompt-tokens 128] [--decode-tokens 32] [--read-ahead-kb 128]
        [--json OUT.json] [--plot OUT.png] [--table OUT.md]

The model: random weights with Qwen3-30B-A3B's per-layer shapes over --layers layers
(benchmarks/transformers_e2e.py writes the Hugging Face checkpoint, one tensor in memory at a
time). llama.cpp gets it through its own converter and quantizer (`Q4_0`; the reference
`Q8_0`), from the pinned source that benchmarks/peers/llama_build.py builds. strata-stream
(--engine transformers, the default) loads the same checkpoint with strata_stream.transformers:
dense weights in torch bf16, the experts from a q4 (group 64) pack on the CPU backend; with
--engine mlx it loads what an mlx-lm user converts (`mlx_lm.convert -q`, everything 4-bit) with
strata_stream.mlx_lm. Experts are 4-bit on both sides, 4.5 bits a weight (Q4_0; q4 g64 with
bf16 scales and biases). Intermediate files (the bf16 GGUF) are deleted once their products
exist.

Both engines take the same token ids (llama_driver.cpp, strata_driver.py): a --prompt-tokens
prompt as one batch, then --decode-tokens ids one at a time (teacher-forced, so both route the
same tokens). Conditions, each run in a fresh memory cgroup after the page cache is dropped
(limits.py):
- --limits: the cgroup's limit as a share of the Q4_0 model file ("none": no cgroup limit);
- the disk: the machine's own read-ahead, and --read-ahead-kb (the usual Linux NVMe default is
  128 KB; llama.cpp's mmap path reads through it), set on the disk for those runs and restored;
- llama.cpp's mmap path with its CPU repack off (what streams from the page cache; `--no-repack`),
  and, where everything fits, its default repacked path.
strata-stream sizes its arena itself (no --arena-gb): what the cgroup leaves after the dense
weights. Each pair runs llama.cpp and strata-stream back to back, the order alternating, --pairs
times; the table gives medians and [min-max], and the ratios pair by pair. Agreement: the share
of positions whose top-1 token equals the Q8_0 reference's (llama.cpp, everything in memory).
Plain transformers (plain mlx-lm with --engine mlx) runs once in each cgroup: whether, and when,
it is killed for memory.

The JSON (--json) is rewritten after every run; --plot draws decode and prompt tok/s and disk
bytes per token per condition; --table docs/peers.md rewrites the table between that page's
markers.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from limits import Outcome, disk_read_ahead_kb, read_ahead, run_limited  # noqa: E402
from llama_build import LlamaCpp, build, default_workdir  # noqa: E402

from common import require_matplotlib  # noqa: E402

_GB = 1e9


def _checkpoint(workdir: Path, layers: int) -> Path:
    from transformers_e2e import QWEN3_30B_A3B, build_checkpoint

    return build_checkpoint(
        workdir / f"qwen3-30b-a3b-shapes-{layers}l", layers, int(QWEN3_30B_A3B["vocab_size"])
    )


def _once(out: Path, what: str, cmd: list[str]) -> Path:
    """`out` made by `cmd` (writing `out`.partial), unless it exists."""
    if not out.exists():
        print(f"{what} -> {out.name} (once)", flush=True)
        partial = out.with_name(out.name + ".partial")
        subprocess.run(
            [c.replace("{out}", str(partial)) for c in cmd], check=True, stdout=subprocess.DEVNULL
        )
        partial.rename(out)
    return out


def prepare(llama: LlamaCpp, checkpoint: Path, engine: str) -> tuple[Path, Path, Path, Path]:
    """(Q4_0 GGUF, Q8_0 GGUF, the model strata-stream loads, its pack), each made once. Q4_0
    comes from a bf16 GGUF (deleted after), Q8_0 straight from the converter."""
    stem = checkpoint.parent / checkpoint.name
    convert = [sys.executable, str(HERE / "gguf_convert.py"), str(llama.source), str(checkpoint)]
    q4 = Path(f"{stem}-Q4_0.gguf")
    if not q4.exists():
        bf16 = _once(
            Path(f"{stem}-bf16.gguf"), "llama.cpp's converter, bf16", [*convert, "{out}", "bf16"]
        )
        _once(q4, "llama-quantize Q4_0", [str(llama.quantize), str(bf16), "{out}", "Q4_0"])
        bf16.unlink()
    q8 = _once(
        Path(f"{stem}-Q8_0.gguf"), "llama.cpp's converter, q8_0", [*convert, "{out}", "q8_0"]
    )
    if engine == "transformers":  # the experts of the bf16 checkpoint, quantized on the way
        model = checkpoint
        how = ["--quantize", "q4", "--group-size", "64"]
    else:  # what an mlx-lm user converts: everything 4-bit, the pack copies its experts
        model = Path(f"{stem}-mlx-q4")
        if not (model / "config.json").exists():
            print(f"mlx_lm.convert -q (4-bit, group 64) -> {model.name} (once)", flush=True)
            subprocess.run(
                [sys.executable, "-m", "mlx_lm", "convert", "--hf-path", str(checkpoint),
                 "--mlx-path", str(model), "-q", "--q-bits", "4", "--q-group-size", "64"],
                check=True, stdout=subprocess.DEVNULL,
            )  # fmt: skip
        how = []
    pack = _once(
        Path(f"{stem}-{engine}-q4g64.strpk"),
        "strata-stream convert",
        [sys.executable, "-m", "strata_stream.cli", "convert", str(model), "-o", "{out}",
         "--quiet", "--force", *how],
    )  # fmt: skip
    return q4, q8, model, pack


def _ids(workdir: Path, n: int, vocab: int, seed: int) -> Path:
    out = workdir / f"ids-{n}-{seed}.bin"
    rng = np.random.default_rng(seed)
    rng.integers(2, vocab, size=n, dtype="<i4").tofile(out)
    return out


class Runner:
    """Runs the drivers under conditions and keeps every row (and the JSON up to date)."""

    def __init__(
        self, args: argparse.Namespace, llama: LlamaCpp, model: Path, ids: Path, head: str
    ) -> None:
        self.a, self.llama, self.model, self.ids, self.head = args, llama, model, ids, head
        self.rows: list[dict[str, Any]] = []
        self.logs = args.workdir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)

    def _run(
        self, engine: str, cmd: list[str], limit: int | None, meta: dict[str, Any]
    ) -> dict[str, Any]:
        n = len(self.rows)
        out = self.logs / f"run{n:03d}.json"
        out.unlink(missing_ok=True)
        outcome: Outcome = run_limited(
            [*cmd, str(out)], limit, self.logs / f"run{n:03d}.log", timeout_s=self.a.timeout
        )
        row = {"engine": engine, "limit_bytes": limit, **meta, **asdict(outcome)}
        if outcome.returncode == 0 and out.exists():
            row.update(json.loads(out.read_text()))
        else:
            log = (self.logs / f"run{n:03d}.log").read_text()
            row["error"] = log[-400:]
            row["no_arena"] = any(why in log for why in _NO_ROOM)
        self.rows.append(row)
        print(_line(row), flush=True)
        if self.a.json:
            doc = {"args": _jsonable(vars(self.a)), "head": self.head, "rows": self.rows}
            self.a.json.write_text(json.dumps(doc, indent=1))
        return row

    def llama_run(self, gguf: Path, mode: str, limit: int | None, **meta: Any) -> dict[str, Any]:
        a = self.a
        cmd = [
            str(self.llama.driver),
            str(gguf),
            str(self.ids),
            str(a.prompt_tokens),
            str(a.decode_tokens),
            str(a.threads),
            mode,
        ]
        return self._run(f"llama.cpp {mode}", cmd, limit, {"model": gguf.name, **meta})

    def strata_run(
        self, pack: Path | None, limit: int | None, **meta: Any
    ) -> dict[str, Any] | None:
        """None, without a run, where strata-stream already found no room for its arena under
        this limit: the same load would fail the same way (the dense weights do not shrink)."""
        a = self.a
        if pack and any(
            r["engine"] == "strata-stream" and r["limit_bytes"] == limit and no_arena(r)
            for r in self.rows
        ):
            return None
        cmd = [
            sys.executable,
            str(HERE / "strata_driver.py"),
            a.engine,
            str(self.model),
            str(pack) if pack else "plain",
            str(self.ids),
            str(a.prompt_tokens),
            str(a.decode_tokens),
            str(a.threads),
            "auto",
        ]
        name = "strata-stream" if pack else f"plain {'mlx-lm' if a.engine == 'mlx' else a.engine}"
        return self._run(name, cmd, limit, {"model": (pack or self.model).name, **meta})


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    """The arguments as the JSON keeps them: paths by name alone (the JSON may be committed)."""
    return {k: v.name if isinstance(v, Path) else v for k, v in d.items()}


# strata-stream's refusals at load when a memory limit leaves it no room: for the arena after
# the dense weights, or for the dense weights a step reads whole (arena_budget.py, and
# transformers/loader.py's _held_back_message).
_NO_ROOM = ("not enough memory for the experts", "not enough memory for the dense weights")


def no_arena(r: dict[str, Any]) -> bool:
    """The run stopped at load: the memory limit left no room for the experts' arena, or for
    the dense weights a step reads whole."""
    return bool(r.get("no_arena")) or any(why in r.get("error", "") for why in _NO_ROOM)


def decode_tps(r: dict[str, Any]) -> float | None:
    return len(r["step_s"]) / sum(r["step_s"]) if r.get("step_s") else None


def prompt_tps(r: dict[str, Any], prompt: int) -> float | None:
    return prompt / r["prompt_s"] if r.get("prompt_s") else None


def _line(r: dict[str, Any]) -> str:
    where = f"limit {r['limit_bytes'] / _GB:.2f} GB" if r["limit_bytes"] else "no limit"
    if "error" in r:
        why = (
            "killed for memory"
            if r["oom_killed"]
            else "refused at load: no room"
            if no_arena(r)
            else f"exit {r['returncode']}"
        )
        return f"  {r['engine']:<22} {where:<16} ra {r['read_ahead_kb']} KB: {why}"
    return (
        f"  {r['engine']:<22} {where:<16} ra {r['read_ahead_kb']} KB: decode "
        f"{decode_tps(r):.2f} tok/s, disk {r['decode_read_bytes'] / len(r['step_s']) / 1e6:.0f}"
        f" MB/token, peak {(r['cgroup_peak_bytes'] or r['peak_rss_bytes']) / _GB:.2f} GB"
    )


def _median_span(values: list[float]) -> str:
    if not values:
        return "-"
    m = statistics.median(values)
    return f"{m:.2f} [{min(values):.2f}-{max(values):.2f}]" if len(values) > 1 else f"{m:.2f}"


def agreement(r: dict[str, Any], ref: dict[str, Any] | None) -> float | None:
    if ref is None or not r.get("top1") or not ref.get("top1"):
        return None
    a, b = r["top1"], ref["top1"]
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def table(rows: list[dict[str, Any]], ref: dict[str, Any] | None, prompt: int) -> str:
    """One row per (condition, engine): medians [min-max] over the pairs, then the ratios of
    strata-stream to llama.cpp's mmap path, pair by pair."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("role") == "reference":
            continue
        groups.setdefault((r["limit_bytes"] or 0, r["read_ahead_kb"], r["engine"]), []).append(r)
    out = [
        "| memory limit | read-ahead | engine | decode tok/s | prompt tok/s | disk MB/token "
        "| peak GB | top-1 agreement with Q8_0 | strata/llama decode | strata/llama prompt |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (limit, ra, engine), rs in sorted(
        groups.items(), key=lambda kv: (-kv[0][0], -kv[0][1], kv[0][2])
    ):
        ok = [r for r in rs if "error" not in r]
        where = f"{limit / _GB:.2f} GB" if limit else "none"
        if not ok:
            why = (
                "killed for memory"
                if any(r["oom_killed"] for r in rs)
                else "refused at load: the limit leaves no room (the dense weights fill it)"
                if any(no_arena(r) for r in rs)
                else "failed"
            )
            out.append(f"| {where} | {ra} KB | {engine} | {why} | | | | | | |")
            continue
        dec = [decode_tps(r) or 0.0 for r in ok]
        pro = [prompt_tps(r, prompt) or 0.0 for r in ok]
        disk = [r["decode_read_bytes"] / len(r["step_s"]) / 1e6 for r in ok]
        peak = [(r["cgroup_peak_bytes"] or r["peak_rss_bytes"]) / _GB for r in ok]
        agree = [x for r in ok if (x := agreement(r, ref)) is not None]
        rd, rp = _pair_ratios(rows, limit, ra) if engine == "strata-stream" else ([], [])
        out.append(
            f"| {where} | {ra} KB | {engine} | {_median_span(dec)} | {_median_span(pro)} "
            f"| {_median_span(disk)} | {_median_span(peak)} | "
            f"{_median_span([100 * x for x in agree])}% | {_median_span(rd)} "
            f"| {_median_span(rp)} |"
        )
    return "\n".join(out)


def _pair_ratios(
    rows: list[dict[str, Any]], limit: int, ra: int
) -> tuple[list[float], list[float]]:
    """strata-stream over llama.cpp mmap, pair by pair (same pair index, same condition)."""
    dec, pro = [], []
    by_pair: dict[int, dict[str, dict[str, Any]]] = {}
    for r in rows:
        if (r["limit_bytes"] or 0) == limit and r["read_ahead_kb"] == ra and "pair" in r:
            by_pair.setdefault(r["pair"], {})[r["engine"]] = r
    for p in by_pair.values():
        s, ll = p.get("strata-stream"), p.get("llama.cpp mmap")
        if s and ll and "error" not in s and "error" not in ll:
            dec.append((decode_tps(s) or 0) / (decode_tps(ll) or 1))
            pro.append(s["prompt_s"] and ll["prompt_s"] / s["prompt_s"])
    return dec, pro


def plot(rows: list[dict[str, Any]], out: Path, prompt: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conds = sorted(
        {
            ((r["limit_bytes"] or 0), r["read_ahead_kb"])
            for r in rows
            if r.get("role") != "reference"
        },
        key=lambda c: (-c[0], -c[1]),
    )
    engines = ["strata-stream", "llama.cpp mmap", "llama.cpp repack"]  # plain mlx-lm: the table
    panels = [
        ("decode tok/s", decode_tps),
        ("prompt tok/s", lambda r: prompt_tps(r, prompt)),
        ("disk MB / decoded token", lambda r: r["decode_read_bytes"] / len(r["step_s"]) / 1e6),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    x = np.arange(len(conds))
    for ax, (name, f) in zip(axes, panels, strict=True):
        for i, e in enumerate(engines):
            vals = []
            for c in conds:
                v = [
                    f(r)
                    for r in rows
                    if ((r["limit_bytes"] or 0), r["read_ahead_kb"]) == c
                    and r["engine"] == e
                    and "error" not in r
                ]
                vals.append(statistics.median(v) if v else 0.0)
            ax.bar(x + (i - 1) * 0.27, vals, 0.27, label=e, color=f"C{i}")
        ax.set_xticks(
            x,
            [
                f"{c[0] / _GB:.1f} GB\nra {c[1]} KB" if c[0] else f"no limit\nra {c[1]} KB"
                for c in conds
            ],
            fontsize=8,
        )
        ax.set_ylabel(name)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=8)
    fig.suptitle(
        "strata-stream and llama.cpp, 4-bit experts, Qwen3-30B-A3B layer shapes (medians)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


_BEGIN, _END = "<!-- peers:table -->", "<!-- /peers:table -->"


def write_region(doc: Path, text: str, markers: tuple[str, str] = (_BEGIN, _END)) -> None:
    """`text` between doc's table markers (the rest of the page is prose kept by hand); a page
    without them gets the table appended. gpu_rows.py writes its own table with its markers."""
    begin, end = markers
    body = doc.read_text() if doc.exists() else ""
    block = f"{begin}\n{text}\n{end}"
    if begin in body and end in body:
        body = body[: body.index(begin)] + block + body[body.index(end) + len(end) :]
    else:
        body = body + ("\n" if body else "") + block + "\n"
    doc.write_text(body)


def report(a: argparse.Namespace, rows: list[dict[str, Any]], head: str) -> None:
    ref = next((r for r in rows if r.get("role") == "reference"), None)
    text = table(rows, ref, a.prompt_tokens)
    print(head)
    print(text)
    if a.table:
        write_region(a.table, head + "\n\n" + text)
        print(f"wrote the table into {a.table}")
    if a.plot:
        plot(rows, a.plot, a.prompt_tokens)


def summarize(a: argparse.Namespace) -> None:
    doc = json.loads(a.summarize.read_text())
    a.prompt_tokens = doc["args"]["prompt_tokens"]
    report(a, doc["rows"], doc.get("head", ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument(
        "--limits",
        nargs="+",
        default=["none", "0.5", "0.25"],
        help="memory limits: 'none', a share of the Q4_0 model (0.5) or a size (2GiB)",
    )
    ap.add_argument(
        "--engine",
        choices=["transformers", "mlx"],
        default="transformers",
        help="strata-stream's front-end (mlx: for Apple silicon; MLX's CPU build "
        "is far slower than torch on Linux)",
    )
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--read-ahead-kb", type=int, default=128)
    ap.add_argument("--timeout", type=float, default=1800, help="seconds a run may take")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None)
    ap.add_argument("--table", type=Path, default=None)
    ap.add_argument(
        "--summarize",
        type=Path,
        default=None,
        help="no runs: the table (and --table, --plot) from an earlier run's --json",
    )
    a = ap.parse_args()
    require_matplotlib(ap, a.plot)
    if a.summarize is not None:
        summarize(a)
        return
    # A stopped comparison still restores the disk's read-ahead (read_ahead's finally).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if os.geteuid() != 0:
        ap.error("needs root: each run gets a memory cgroup and a cold page cache")
    from strata_stream.config import parse_size
    from strata_stream.errors import ConfigError

    limits: list[float | int | None] = []
    for s in a.limits:
        try:
            limits.append(
                None if s == "none" else float(s) if "." in s else parse_size(s, "--limits")
            )
        except (ValueError, ConfigError):
            ap.error(f"--limits: {s!r} is not 'none', a share of the model (0.5) or a size (2GiB)")
    a.workdir = a.workdir or default_workdir()
    a.workdir.mkdir(parents=True, exist_ok=True)

    llama = build(a.workdir)
    q4, q8, model, pack = prepare(llama, _checkpoint(a.workdir, a.layers), a.engine)
    ids = _ids(a.workdir, a.prompt_tokens + a.decode_tokens, 151936, a.seed)
    model_bytes = q4.stat().st_size
    machine_ra = disk_read_ahead_kb(q4) or -1
    print(
        f"Q4_0 model {model_bytes / _GB:.2f} GB, strata pack {pack.stat().st_size / _GB:.2f} GB; "
        f"disk read-ahead {machine_ra} KB",
        flush=True,
    )
    head = (
        f"{a.layers} layers of Qwen3-30B-A3B's shapes; Q4_0 {model_bytes / _GB:.2f} GB, "
        f"strata-stream ({a.engine} front-end, experts on its CPU backend) pack "
        f"{pack.stat().st_size / _GB:.2f} GB; {a.threads} threads; "
        f"prompt {a.prompt_tokens}, teacher-forced decode {a.decode_tokens}; "
        f"{a.pairs} pairs; the machine's disk read-ahead {machine_ra} KB."
    )
    r = Runner(a, llama, model, ids, head)
    r.llama_run(q8, "repack", None, role="reference", read_ahead_kb=machine_ra)
    for share in limits:
        limit = share if isinstance(share, int) or share is None else int(share * model_bytes)
        for ra in (machine_ra, a.read_ahead_kb):
            with read_ahead(q4, ra) as took:
                for p in range(a.pairs):  # llama.cpp first in even pairs, strata-stream in odd
                    for engine in ("llama", "strata") if p % 2 == 0 else ("strata", "llama"):
                        if engine == "llama":
                            r.llama_run(q4, "mmap", limit, pair=p, read_ahead_kb=took)
                        else:
                            r.strata_run(pack, limit, pair=p, read_ahead_kb=took)
        if limit is None:
            for p in range(a.pairs):
                r.llama_run(q4, "repack", None, read_ahead_kb=machine_ra, pair=p)
        else:
            r.strata_run(None, limit, read_ahead_kb=machine_ra)
    report(a, r.rows, head)


if __name__ == "__main__":
    main()
