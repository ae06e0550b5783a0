"""The CUDA backend on a GPU: MoE layer time per backend at Qwen3-30B-A3B expert shapes.

    python benchmarks/cuda.py [--layers 4] [--experts 32] [--tokens 16] [--json OUT]

Writes a q4 (group 64, f16 scales) pack with the shapes of Qwen3-30B-A3B's experts (hidden
2048, moe_intermediate 768, top-8; fewer layers and experts, which the per-layer time does not
depend on), keeps it all resident, and times Window.moe per layer for decode tokens and for
prompt chunks on backend="cpu" and backend="cuda": wall microseconds per layer call (median),
and the expert bytes a decode layer reads over that time. A tiny pack (hidden 64) gives the
handshake's own cost per layer, the kernels being negligible there.

CUDA runs twice: with the arena mirrored in device memory (STRATA_CUDA_ARENA=device, the
default: all resident, decode reads HBM) and with the kernels reading the host arena through
the mapping (STRATA_CUDA_ARENA=mapped: decode reads its experts over PCIe).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from strata_stream import ExpertPack, ExpertStream, StreamConfig, Window
from strata_stream.pack import Geometry, write_pack
from strata_stream.pack.quant import QuantizedMatrix


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--prompt-rows", type=int, nargs="*", default=[128, 512])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    results: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tiny = make_pack(Path(tmp) / "tiny.strpk", 4, 16, 64, 64, 4)
        big = make_pack(Path(tmp) / "qwen3.strpk", args.layers, args.experts, 2048, 768, 8)
        with ExpertPack.open(big) as p:
            decode_bytes = 8 * p.record_bytes
        for name, backend, arena in (
            ("cpu", "cpu", ""),
            ("cuda-device-arena", "cuda", "device"),
            ("cuda-mapped-arena", "cuda", "mapped"),
        ):
            os.environ["STRATA_CUDA_ARENA"] = arena  # read when a CUDA backend is made
            r: dict[str, float] = {}
            r["handshake_layer_us"] = time_layers(tiny, backend, 1, args.tokens)
            r["decode_layer_us"] = time_layers(big, backend, 1, args.tokens)
            r["decode_gb_s"] = decode_bytes / (r["decode_layer_us"] * 1e-6) / 1e9
            for rows in args.prompt_rows:
                r[f"prompt{rows}_layer_us"] = time_layers(big, backend, rows, 2)
            results[name] = r
            print(name, json.dumps(r), flush=True)
    for rows in args.prompt_rows:
        t = torch_prompt_us(rows, args.experts, 2048, 768, 8)
        if t is not None:
            results.setdefault("torch-bf16-bmm", {})[f"prompt{rows}_layer_us"] = t  # type: ignore[union-attr]
    print("torch-bf16-bmm", json.dumps(results.get("torch-bf16-bmm")), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
