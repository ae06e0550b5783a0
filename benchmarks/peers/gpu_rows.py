"""The peer comparison's GPU rows: strata-stream's CUDA backend beside llama.cpp CUDA
(`-ngl 99`, `--n-cpu-moe N`) and accelerate's offload, at the same GPU memory.

    python benchmarks/peers/gpu_rows.py prepare [--workdir DIR] [--layers 4] [--jobs 16]
    python benchmarks/peers/gpu_rows.py run [--workdir DIR] [--layers 4] [--pairs 2]
        [--fractions 0.1 0.25] [--json OUT.json]
    python benchmarks/peers/gpu_rows.py summarize OUT.json [--table docs/peers.md] [--plot P.png]

benchmarks/peers/device.sh runs `prepare` and `run` on the GPU machine, one device call each.

prepare (each step once: a later call finds its output and skips it; each step timed):
- `source`: the trimmed llama.cpp (llama_trim.py's archive, from the pinned sdist) unpacked;
- `llama`: its CUDA build (started first, in the background: the longest step), Release, for
  sm_90 alone, with libllama and llama-quantize and nothing else (no examples, tests, server,
  other backends; flash-attention kernels off unless --flash-attn: their template instances are
  most of the build, and at these context lengths attention is a small part of a token);
- `checkpoint`: random weights with Qwen3-30B-A3B's shapes over --layers layers
  (benchmarks/transformers_e2e.py, one tensor in memory at a time);
- `gguf`: its bf16 GGUF (llama.cpp's converter through gguf_convert.py), then `Q4_0` with
  llama-quantize, the bf16 GGUF deleted once Q4_0 exists;
- `driver`: llama_gpu_driver.cpp compiled against the build;
- `pack`: `strata-stream convert --quantize q4 --group-size 64` (needs strata_stream's _core).
With --device cpu the build leaves CUDA out, the rest alike (a machine without a GPU checks the
whole path at a small --layers).

run: at each GPU-memory level, its runs, the order rotating from pair to pair:
- a fraction f of --fractions: strata-stream with an arena of f of its pack's expert bytes;
  llama.cpp `-ngl 99 --n-cpu-moe N` with N = floor(layers * (1 - f)) (at least f of its expert
  layers on the GPU); accelerate's offload with the GPU capped at the bytes strata-stream's
  weights take there (its bf16 dense weights and the arena), as `device_map="auto"` places the
  modules ("accelerate auto") and with the device map written out as --n-cpu-moe places
  tensors, the first layers' experts in host memory ("accelerate experts"; gpu_driver.py);
- everything resident: strata-stream's arena holding every expert, llama.cpp `-ngl 99`, plain
  transformers with every weight on the GPU (bf16; its first run is the top-1 reference).
Every run is a fresh process on the same token ids (teacher-forced decode after --warmup untimed
steps on other ids). GPU memory: each driver's device-wide used bytes after its last step (free
memory before the load minus after; the CUDA context not counted) and the peak that nvidia-smi
saw during the run over its reading before (the context counted). The JSON is rewritten after
every run; `summarize` writes the table between docs/peers.md's GPU markers and the PNG.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from llama_build import _cpu_flags  # noqa: E402
from llama_trim import DEFAULT_OUT as TRIM_ARCHIVE  # noqa: E402
from llama_trim import extract  # noqa: E402
from run import _median_span, agreement, decode_tps, prompt_tps, write_region  # noqa: E402

_GB = 1e9
VOCAB = 151936
# gpu_driver.py's accelerate engines by --accelerate's names, and their rows' engine names.
ACCELERATE = {"auto": "accelerate auto", "experts": "accelerate experts"}
DRIVER = {"strata-stream": "strata", "accelerate auto": "accelerate",
          "accelerate experts": "accelerate-experts", "plain transformers": "plain"}  # fmt: skip
STEPS = ("source", "llama", "checkpoint", "gguf", "driver", "pack")
BEGIN, END = "<!-- peers:gpu-table -->", "<!-- /peers:gpu-table -->"


def _log(msg: str) -> None:
    print(msg, flush=True)


class Steps:
    """Timed, skippable steps; their times kept in WORKDIR/prepare_times.json (merged with what
    another prepare process beside this one wrote there)."""

    def __init__(self, workdir: Path) -> None:
        self.file = workdir / "prepare_times.json"

    def record(self, name: str, seconds: float) -> None:
        times = json.loads(self.file.read_text()) if self.file.exists() else {}
        times[name] = round(seconds, 1)
        self.file.write_text(json.dumps(times, indent=1))
        _log(f"step {name}: {times[name]} s")

    def once(self, name: str, done: Path, make: Any) -> None:
        if done.exists():
            _log(f"step {name}: {done.name} exists, skipped")
            return
        t0 = time.perf_counter()
        _log(f"step {name} ...")
        make()
        self.record(name, time.perf_counter() - t0)


def _sh(cmd: list[str], log: Path) -> None:
    _log("+ " + " ".join(cmd))
    with open(log, "a") as f:
        if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode != 0:
            raise SystemExit(f"failed: {' '.join(cmd)}; see {log}")


def llama_cmake(source: Path, build: Path, device: str, flash_attn: bool) -> list[str]:
    """The configure line: libllama and llama-quantize only; CUDA for sm_90 alone."""
    cmd = ["cmake", "-S", str(source), "-B", str(build), "-G", "Ninja",
           "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
           "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
           "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_TOOLS=ON", *_cpu_flags()]  # fmt: skip
    if device == "cuda":
        cmd += ["-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90-real",
                "-DGGML_CUDA_NCCL=OFF", f"-DGGML_CUDA_FA={'ON' if flash_attn else 'OFF'}",
                "-DGGML_CUDA_FA_QUANTS=f16-f16"]  # fmt: skip
        nvcc = shutil.which("nvcc")
        if nvcc is None and Path("/usr/local/cuda/bin/nvcc").exists():
            nvcc = "/usr/local/cuda/bin/nvcc"
            cmd.append(f"-DCMAKE_CUDA_COMPILER={nvcc}")
        toolkit = Path(nvcc).resolve().parents[1] if nvcc else None
        cmd += cublas_flags(toolkit) + cuda_driver_flags(toolkit)
    return cmd


def cuda_driver_flags(toolkit: Path | None) -> list[str]:
    """ggml-cuda links the driver library for its virtual-memory pool. Where neither the toolkit
    (nor its stubs) nor the system's library folders hold a libcuda.so, the pool is left out
    (GGML_CUDA_NO_VMM: cudaMalloc'd pools instead), so the build needs no driver at link time."""
    dirs = [Path("/usr/lib/x86_64-linux-gnu"), Path("/usr/lib64"), Path("/usr/local/nvidia/lib64")]
    if toolkit is not None:
        dirs += [toolkit / "lib64", toolkit / "lib64" / "stubs", *toolkit.glob("targets/*/lib"),
                 *toolkit.glob("targets/*/lib/stubs")]  # fmt: skip
    for d in dirs:
        if (d / "libcuda.so").exists():
            return []  # FindCUDAToolkit's own search finds these
    for d in dirs:
        found = sorted(d.glob("libcuda.so.*"))
        if found:
            return [f"-DCUDA_cuda_driver_LIBRARY={found[0]}"]
    return ["-DGGML_CUDA_NO_VMM=ON"]


def cublas_flags(toolkit: Path | None) -> list[str]:
    """ggml-cuda links cuBLAS. Where the CUDA toolkit holds none (an image with nvcc beside
    PyTorch's CUDA wheels), CMake is pointed at the nvidia-cublas wheel's headers and libraries,
    which PyTorch installs; nothing where the toolkit has its own."""
    import importlib.util

    if toolkit is not None:
        for d in (toolkit / "lib64", toolkit / "lib", *toolkit.glob("targets/*/lib")):
            if any(d.glob("libcublas.so*")):
                return []
    spec = importlib.util.find_spec("nvidia")
    for root in map(Path, (spec.submodule_search_locations or []) if spec else []):
        lib = sorted(root.rglob("libcublas.so*"))
        lt = sorted(root.rglob("libcublasLt.so*"))
        inc = sorted(root.rglob("cublas_v2.h"))
        if lib and lt and inc:
            return [f"-DCUDA_cublas_LIBRARY={lib[0]}", f"-DCUDA_cublasLt_LIBRARY={lt[0]}",
                    f"-DCMAKE_CUDA_FLAGS=-I{inc[0].parent}"]  # fmt: skip
    return []


class Paths:
    def __init__(self, workdir: Path, layers: int, device: str) -> None:
        self.work = workdir
        self.source = workdir / "src" / "llama.cpp"
        self.build = workdir / ("llama-build-cuda" if device == "cuda" else "llama-build-cpu")
        self.quantize = self.build / "bin" / "llama-quantize"
        self.driver = self.build / "llama_gpu_driver"
        self.checkpoint = workdir / f"qwen3-30b-a3b-shapes-{layers}l"
        self.bf16 = workdir / f"{self.checkpoint.name}-bf16.gguf"
        self.q4 = workdir / f"{self.checkpoint.name}-Q4_0.gguf"
        self.pack = workdir / f"{self.checkpoint.name}-q4g64.strpk"
        self.logs = workdir / "logs"


def _partial(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


def prepare(a: argparse.Namespace) -> None:
    p = Paths(a.workdir, a.layers, a.device)
    p.logs.mkdir(parents=True, exist_ok=True)
    steps = Steps(a.workdir)
    want = set(a.steps)
    if "source" in want:
        steps.once("source", p.source / "CMakeLists.txt", lambda: extract(a.trim, p.source.parent))
    build_job: subprocess.Popen[bytes] | None = None
    t_build = time.perf_counter()
    if "llama" in want and not p.quantize.exists():
        # Configure and build in the background: the checkpoint and its GGUF need no build.
        log = p.logs / "llama_build.log"
        configure = llama_cmake(p.source, p.build, a.device, a.flash_attn)
        script = (
            f"{' '.join(configure)} && cmake --build {p.build} -j {a.jobs} "
            "--target llama llama-quantize"
        )
        _log(f"step llama (background): {script}")
        with open(log, "w") as f:  # the child keeps its own descriptor
            build_job = subprocess.Popen(["bash", "-c", script], stdout=f,
                                         stderr=subprocess.STDOUT)  # fmt: skip
    elif "llama" in want:
        _log(f"step llama: {p.quantize.name} exists, skipped")
    if "checkpoint" in want:
        from transformers_e2e import build_checkpoint

        steps.once("checkpoint", p.checkpoint / ".complete",
                   lambda: build_checkpoint(p.checkpoint, a.layers, VOCAB))  # fmt: skip
    if "gguf" in want and not p.q4.exists():
        convert = [sys.executable, str(HERE / "gguf_convert.py"), str(p.source),
                   str(p.checkpoint), str(_partial(p.bf16)), "bf16"]  # fmt: skip

        def bf16() -> None:
            _sh(convert, p.logs / "gguf_bf16.log")
            _partial(p.bf16).rename(p.bf16)

        steps.once("gguf_bf16", p.bf16, bf16)
    if build_job is not None:
        rc = build_job.wait()
        steps.record("llama", time.perf_counter() - t_build)
        _log(f"step llama: rc {rc} (its time overlaps the steps above)")
        if rc != 0:
            raise SystemExit(f"the llama.cpp build failed; see {p.logs / 'llama_build.log'}")
    if "gguf" in want:

        def q4() -> None:
            _sh([str(p.quantize), str(p.bf16), str(_partial(p.q4)), "Q4_0"],
                p.logs / "quantize.log")  # fmt: skip
            _partial(p.q4).rename(p.q4)
            p.bf16.unlink()

        steps.once("quantize_q4_0", p.q4, q4)
    if "driver" in want:

        def driver() -> None:
            libs = sorted({str(x.parent) for x in p.build.rglob("lib*.so")})
            _sh(["c++", "-std=c++17", "-O2", str(HERE / "llama_gpu_driver.cpp"),
                 f"-I{p.source / 'include'}", f"-I{p.source / 'ggml' / 'include'}",
                 "-o", str(p.driver), *(f"-L{d}" for d in libs),
                 *(f"-Wl,-rpath,{d}" for d in libs), "-lllama", "-lggml", "-lggml-base"],
                p.logs / "driver_build.log")  # fmt: skip

        steps.once("driver", p.driver, driver)
    if "pack" in want:

        def pack() -> None:
            _sh([sys.executable, "-m", "strata_stream.cli", "convert", str(p.checkpoint),
                 "-o", str(_partial(p.pack)), "--quiet", "--force", "--quantize", "q4",
                 "--group-size", "64"], p.logs / "pack.log")  # fmt: skip
            _partial(p.pack).rename(p.pack)

        steps.once("pack", p.pack, pack)
    if steps.file.exists():
        _log(f"prepare times (s): {steps.file.read_text()}")


# ---- the runs -----------------------------------------------------------------------------------


class GpuPeak:
    """The GPU's used memory at its highest during a run, over its reading before (nvidia-smi,
    device-wide, polled); None without nvidia-smi."""

    def __init__(self) -> None:
        self.tool = shutil.which("nvidia-smi")
        self.base: int | None = None
        self.peak: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _read(self) -> int | None:
        if self.tool is None:
            return None
        r = subprocess.run([self.tool, "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                            "--id=0"], capture_output=True, text=True)  # fmt: skip
        try:
            return int(r.stdout.split()[0]) << 20  # MiB
        except (IndexError, ValueError):
            return None

    def _poll(self) -> None:
        while not self._stop.wait(0.2):
            v = self._read()
            if v is not None:
                self.peak = max(self.peak or 0, v)

    def __enter__(self) -> GpuPeak:
        self.base = self._read()
        if self.base is not None:
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def used(self) -> int | None:
        return None if self.base is None or self.peak is None else self.peak - self.base


def _gpu_name() -> str:
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return "no GPU (CPU check)"
    r = subprocess.run([tool, "--query-gpu=name", "--format=csv,noheader", "--id=0"],
                       capture_output=True, text=True)  # fmt: skip
    return r.stdout.strip() or "unknown GPU"


def _dense_bytes(checkpoint: Path) -> int:
    """Bytes of the checkpoint's tensors other than the routed experts (safetensors headers)."""
    total = 0
    for f in checkpoint.glob("*.safetensors"):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        for name, t in header.items():
            if name != "__metadata__" and ".experts." not in name:
                total += t["data_offsets"][1] - t["data_offsets"][0]
    return total


def plan(layers: int, fractions: list[float], accelerate: list[str]) -> list[dict[str, Any]]:
    """The GPU-memory levels and the runs of each: (engine, setting) per level."""
    levels = []
    for f in sorted(fractions):
        n_cpu = math.floor(layers * (1 - f) + 1e-9)
        runs: list[tuple[str, dict[str, Any]]] = [
            ("strata-stream", {"fraction": f}),
            ("llama.cpp", {"ngl": 99, "n_cpu_moe": n_cpu}),
        ]
        runs += [(ACCELERATE[m], {"fraction": f}) for m in accelerate]
        levels.append({"level": f"arena {f:.0%}", "fraction": f, "runs": runs})
    levels.append({"level": "everything resident", "fraction": 1.0, "runs": [
        ("strata-stream", {"fraction": 1.0}),
        ("llama.cpp", {"ngl": 99, "n_cpu_moe": 0}),
        ("plain transformers", {})]})  # fmt: skip
    return levels


def setting_text(engine: str, s: dict[str, Any], r: dict[str, Any] | None = None) -> str:
    if engine == "llama.cpp":
        return f"-ngl {s['ngl']} --n-cpu-moe {s['n_cpu_moe']}" if s["n_cpu_moe"] else "-ngl 99"
    if engine == "strata-stream":
        return f"arena {s['fraction']:.0%}"
    if engine.startswith("accelerate"):
        r = r or {}
        cap = r.get("budget_bytes")
        text = f"GPU cap {cap / _GB:.2f} GB" if cap else "GPU cap"
        placed = r.get("device_map")
        if placed:  # modules by device, as accelerate placed them
            where = ", ".join(f"{n} on {d}" for d, n in sorted(placed.items()))
            text += f" ({where})"
        return text
    return "every weight on the GPU"


def run(a: argparse.Namespace) -> None:
    from strata_stream import ExpertPack

    p = Paths(a.workdir, a.layers, a.device)
    for need in (p.checkpoint / ".complete", p.q4, p.pack, p.driver):
        if not need.exists():
            raise SystemExit(f"{need} is missing: run `gpu_rows.py prepare` first")
    p.logs.mkdir(parents=True, exist_ok=True)
    ids = a.workdir / f"ids-{a.prompt_tokens + a.decode_tokens}-{a.seed}.bin"
    import numpy as np

    rng = np.random.default_rng(a.seed)
    rng.integers(2, VOCAB, size=a.prompt_tokens + a.decode_tokens, dtype="<i4").tofile(ids)
    with ExpertPack.open(p.pack) as pk:
        experts = int(pk.geometry.n_records * pk.record_stride)
    dense = _dense_bytes(p.checkpoint)
    gpu = a.device == "cuda"
    where = f"one {_gpu_name()}" if gpu else "the CPU (a check of the harness, no GPU)"
    llama = f"CUDA (sm_90, flash attention {'on' if a.flash_attn else 'off'})" if gpu else "CPU"
    head = (
        f"{a.layers} layers of Qwen3-30B-A3B's shapes on {where}; Q4_0 "
        f"{p.q4.stat().st_size / _GB:.2f} GB, strata-stream pack {p.pack.stat().st_size / _GB:.2f}"
        f" GB (experts {experts / _GB:.2f} GB; transformers front-end, bf16 dense weights "
        f"{dense / _GB:.2f} GB, experts on its {a.device} backend); llama.cpp {llama} with "
        f"{a.threads} CPU threads; prompt {a.prompt_tokens}, teacher-forced decode "
        f"{a.decode_tokens} after {a.warmup} untimed steps; {a.pairs} pairs."
    )
    rows: list[dict[str, Any]] = []
    if a.resume and a.json and a.json.exists():  # an earlier call's rows, kept where they ran
        earlier = json.loads(a.json.read_text())
        rows = [r for r in earlier["rows"] if "error" not in r]
        _log(f"resuming: {len(rows)} runs of {a.json} kept")
    levels = plan(a.layers, a.fractions, a.accelerate)
    t_start = time.perf_counter()

    def save() -> None:
        if a.json:
            doc = {"head": head, "args": {k: str(v) if isinstance(v, Path) else v
                                          for k, v in vars(a).items()},
                   "levels": [{**lv, "runs": [list(x) for x in lv["runs"]]} for lv in levels],
                   "rows": rows}  # fmt: skip
            a.json.write_text(json.dumps(doc, indent=1))

    def one(level: dict[str, Any], engine: str, s: dict[str, Any], pair: int) -> None:
        n = len(list(p.logs.glob("gpu*.log")))  # unique across resumed calls
        out, log = p.logs / f"gpu{n:03d}.json", p.logs / f"gpu{n:03d}.log"
        out.unlink(missing_ok=True)
        budget = 0
        if engine == "llama.cpp":
            cmd = [str(p.driver), str(p.q4), str(ids), str(a.prompt_tokens),
                   str(a.decode_tokens), str(a.threads), str(s["ngl"]), str(s["n_cpu_moe"]),
                   str(a.warmup), str(out)]  # fmt: skip
        else:
            kind = DRIVER[engine]
            arena = int(experts * s.get("fraction", 1.0))
            budget = arena if kind == "strata" else 0 if kind == "plain" else dense + arena
            cmd = [sys.executable, str(HERE / "gpu_driver.py"), kind, str(p.checkpoint),
                   str(p.pack), str(ids), str(a.prompt_tokens), str(a.decode_tokens),
                   str(a.warmup), a.device, str(budget), str(out)]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
        t0 = time.perf_counter()
        with GpuPeak() as peak, open(log, "w") as f:
            try:
                rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                    timeout=a.timeout).returncode  # fmt: skip
            except subprocess.TimeoutExpired:
                rc = -9
        row: dict[str, Any] = {"level": level["level"], "fraction": level["fraction"],
                               "engine": engine, "setting": s, "pair": pair, "returncode": rc,
                               "wall_s": time.perf_counter() - t0, "budget_bytes": budget,
                               "gpu_peak_bytes": peak.used()}  # fmt: skip
        if rc == 0 and out.exists():
            row.update(json.loads(out.read_text()))
        else:
            row["error"] = log.read_text()[-600:]
        rows.append(row)
        save()
        _log(_line(row, a.prompt_tokens))

    def done(level: dict[str, Any], engine: str, s: dict[str, Any], pair: int) -> bool:
        return any(r["level"] == level["level"] and r["engine"] == engine and r["pair"] == pair
                   and r["setting"] == s for r in rows)  # fmt: skip

    for pair in range(a.pairs):
        for level in levels:
            runs = level["runs"]
            k = pair % len(runs)  # rotate who goes first
            for engine, s in runs[k:] + runs[:k]:
                if done(level, engine, s, pair):
                    continue
                if a.budget_s and time.perf_counter() - t_start > a.budget_s:
                    _log(f"--budget-s {a.budget_s:.0f} spent: the rest waits for --resume")
                    save()
                    report(a, {"head": head, "rows": rows})
                    return
                one(level, engine, s, pair)
    save()
    report(a, {"head": head, "rows": rows})


def _line(r: dict[str, Any], prompt: int) -> str:
    what = f"  {r['level']:<20} {r['engine']:<20} {setting_text(r['engine'], r['setting'], r)}"
    if "error" in r:
        return f"{what}: failed (exit {r['returncode']}): {r['error'][-200:]!r}"
    gpu = r.get("gpu_used_bytes")
    return (
        f"{what}: decode {decode_tps(r):.2f} tok/s, prompt {prompt_tps(r, prompt):.1f} tok/s, "
        f"GPU {gpu / _GB if gpu is not None and gpu >= 0 else float('nan'):.2f} GB"
    )


# ---- the table and the plot ---------------------------------------------------------------------


def _gb(v: Any) -> float | None:
    return v / _GB if isinstance(v, int) and v >= 0 else None


def table(rows: list[dict[str, Any]], prompt: int) -> str:
    """One row per (level, engine, setting): medians [min-max] over pairs; on each peer's row,
    strata-stream at the same level over it, pair by pair."""
    ref = next((r for r in rows if r["engine"] == "plain transformers" and "error" not in r), None)
    order = {"strata-stream": 0, "llama.cpp": 1, "accelerate experts": 2, "accelerate auto": 3,
             "plain transformers": 4}  # fmt: skip
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        key = (r["fraction"], r["level"], order.get(r["engine"], 9), r["engine"],
               json.dumps(r["setting"], sort_keys=True))  # fmt: skip
        groups.setdefault(key, []).append(r)
    out = [
        "| GPU memory level | engine | setting | decode tok/s | prompt tok/s | GPU GB used "
        "| GPU GB peak (nvidia-smi) | top-1 agreement with plain bf16 | strata-stream / this, "
        "decode | strata-stream / this, prompt |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (fraction, level, _, engine, _), rs in sorted(groups.items(), key=lambda kv: kv[0][:3]):
        ok = [r for r in rs if "error" not in r]
        setting = setting_text(engine, rs[0]["setting"], rs[0])
        if not ok:
            out.append(f"| {level} | {engine} | {setting} | failed | | | | | | |")
            continue
        dec = [decode_tps(r) or 0.0 for r in ok]
        pro = [prompt_tps(r, prompt) or 0.0 for r in ok]
        used = [x for r in ok if (x := _gb(r.get("gpu_used_bytes"))) is not None]
        peak = [x for r in ok if (x := _gb(r.get("gpu_peak_bytes"))) is not None]
        agree = [100 * x for r in ok if r is not ref and (x := agreement(r, ref)) is not None]
        rd, rp = ([], []) if engine == "strata-stream" else _ratios(rows, fraction, ok)
        out.append(
            f"| {level} | {engine} | {setting} | {_median_span(dec)} | {_median_span(pro)} "
            f"| {_median_span(used)} | {_median_span(peak)} | "
            f"{_median_span(agree) + '%' if agree else '-'} | {_median_span(rd)} "
            f"| {_median_span(rp)} |"
        )
    return "\n".join(out)


def _ratios(
    rows: list[dict[str, Any]], fraction: float, peers: list[dict[str, Any]]
) -> tuple[list[float], list[float]]:
    dec, pro = [], []
    for peer in peers:
        s = next((r for r in rows if r["engine"] == "strata-stream" and r["fraction"] == fraction
                  and r["pair"] == peer["pair"] and "error" not in r), None)  # fmt: skip
        if s is not None:
            dec.append(sum(peer["step_s"]) / sum(s["step_s"]))
            pro.append(peer["prompt_s"] / s["prompt_s"])
    return dec, pro


def plot(rows: list[dict[str, Any]], out: Path, prompt: int, head: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    levels = sorted({(r["fraction"], r["level"]) for r in rows})
    engines = ["strata-stream", "llama.cpp", "accelerate experts", "accelerate auto",
               "plain transformers"]  # fmt: skip
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    x = np.arange(len(levels))
    panels = [("decode tok/s", decode_tps), ("prompt tok/s", lambda r: prompt_tps(r, prompt))]
    for ax, (name, f) in zip(axes, panels, strict=True):
        for i, e in enumerate(engines):
            vals = []
            for _, lv in levels:
                v = [y for r in rows
                     if r["level"] == lv and r["engine"] == e and "error" not in r
                     and (y := f(r)) is not None]  # fmt: skip
                vals.append(statistics.median(v) if v else 0.0)
            ax.bar(x + (i - 2) * 0.16, vals, 0.16, label=e, color=f"C{i}")
        ax.set_xticks(x, [lv for _, lv in levels], fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel(name + " (log)")
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=8)
    fig.suptitle(head.split(";")[0] + " (medians)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    _log(f"wrote {out}")


def report(a: argparse.Namespace, doc: dict[str, Any]) -> None:
    prompt = a.prompt_tokens
    text = table(doc["rows"], prompt)
    _log(doc["head"])
    _log(text)
    if a.table:
        write_region(a.table, doc["head"] + "\n\n" + text, (BEGIN, END))
        _log(f"wrote the GPU table into {a.table}")
    if a.plot:
        plot(doc["rows"], a.plot, prompt, doc["head"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--workdir", type=Path, default=Path("/tmp/peers-gpu"))
    common.add_argument("--layers", type=int, default=4)
    common.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: the same path on a machine without a GPU (a check)")  # fmt: skip
    common.add_argument(
        "--flash-attn",
        action="store_true",
        help="build llama.cpp's CUDA flash-attention kernels (f16 KV only)",
    )
    pr = sub.add_parser("prepare", parents=[common])
    pr.add_argument("--trim", type=Path, default=TRIM_ARCHIVE, help="llama_trim.py's archive")
    pr.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    pr.add_argument("--steps", nargs="+", default=list(STEPS), choices=STEPS)
    ru = sub.add_parser("run", parents=[common])
    ru.add_argument("--pairs", type=int, default=2)
    ru.add_argument("--accelerate", nargs="*", choices=sorted(ACCELERATE),
                    default=["experts", "auto"],
                    help="accelerate's offload: experts (dense weights on the GPU, the first "
                    "layers' experts in host memory) and auto (device_map='auto')")  # fmt: skip
    ru.add_argument("--fractions", type=float, nargs="+", default=[0.1, 0.25])
    ru.add_argument("--prompt-tokens", type=int, default=128)
    ru.add_argument("--decode-tokens", type=int, default=32)
    ru.add_argument("--warmup", type=int, default=4)
    ru.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ru.add_argument("--timeout", type=float, default=300, help="seconds one run may take")
    ru.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="start no run after this many seconds (a bounded device call)",
    )
    ru.add_argument("--resume", action="store_true",
                    help="keep --json's successful runs and do only the missing ones")  # fmt: skip
    ru.add_argument("--seed", type=int, default=0)
    ru.add_argument("--json", type=Path, default=None)
    for q in (ru, sub.add_parser("summarize")):
        q.add_argument("--table", type=Path, default=None, help="docs/peers.md")
        q.add_argument("--plot", type=Path, default=None)
    sm = sub.choices["summarize"]
    sm.add_argument("json_in", type=Path)
    a = ap.parse_args()
    if a.cmd != "prepare" and a.plot is not None:
        from common import require_matplotlib

        require_matplotlib(ap, a.plot)
    if a.cmd == "prepare":
        a.workdir.mkdir(parents=True, exist_ok=True)
        if "source" in a.steps and not a.trim.exists():
            ap.error(f"{a.trim}: no such archive (python benchmarks/peers/llama_trim.py)")
        prepare(a)
    elif a.cmd == "run":
        if a.warmup > a.decode_tokens:
            ap.error("--warmup: at most --decode-tokens")
        run(a)
    else:
        if not a.json_in.exists():
            ap.error(f"{a.json_in}: no such file")
        doc = json.loads(a.json_in.read_text())
        a.prompt_tokens = int(doc["args"]["prompt_tokens"])
        report(a, doc)


if __name__ == "__main__":
    main()
