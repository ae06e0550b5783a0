"""Metal backend parity on a GPU: every pack format through Window(backend=...) against the CPU
backend and the numpy oracle, and I11 (bit-identical output at a 25% arena and all-resident).

    python benchmarks/apple/parity.py [--backend metal] [--reference cpu] [--json OUT]

Per format: a small pack, the same inputs (a prompt chunk, then decode rows) through every
layer. Reports the largest difference relative to the reference's output magnitude, the same
against tests/oracle.py, and whether the streamed run at a 25% arena equals the all-resident one
bit for bit. Exits 1 on a failure. Runs anywhere the backend exists (with --backend cpu it checks
the script itself).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from oracle import moe_reference  # noqa: E402
from strata_stream import ExpertPack, ExpertStream, StreamConfig, Window  # noqa: E402
from strata_stream.pack import Geometry, write_pack  # noqa: E402

FORMATS: list[tuple[str, int, str]] = [("f32", 64, "f16"), ("f16", 64, "f16"), ("bf16", 64, "f16")]
FORMATS += [(q, g, s) for q in ("q4", "q8") for g in (32, 64, 128) for s in ("f32", "f16", "bf16")]
REL_TOL_BACKEND = 1e-4
REL_TOL_ORACLE = 1e-3


def fmt_name(fmt: tuple[str, int, str]) -> str:
    w, g, s = fmt
    return w if not w.startswith("q") else f"{w}_g{g}_s{s}"


def make_pack(path: Path, fmt: tuple[str, int, str]) -> Path:
    w, group, scales = fmt
    g = Geometry(4, 16, 4, 256, 128, "softmax_topk", True)

    def experts(layer: int, expert: int) -> tuple[npt.NDArray[np.float32], ...]:
        rng = np.random.default_rng((5, layer, expert))
        shapes = ((128, 256), (128, 256), (256, 128))
        return tuple((rng.standard_normal(s) / np.sqrt(s[1])).astype(np.float32) for s in shapes)

    rng = np.random.default_rng(9)
    routers = [rng.standard_normal((16, 256)).astype(np.float32) for _ in range(4)]
    return write_pack(
        path,
        g,
        routers,
        experts,
        weight_format=w,
        group_size=group,
        scale_dtype=scales,
        progress=False,
    )


def run(
    path: Path, backend: str, arena_fraction: float, inputs: list[npt.NDArray[np.float32]]
) -> list[npt.NDArray[np.float32]]:
    with ExpertPack.open(path) as pack:
        n, stride = pack.n_records, pack.record_stride
    # Exact-size slots; the small arena still holds two layers' routed experts.
    config = StreamConfig(arena_bytes=max(8, int(n * arena_fraction)) * stride, direct_io=False)
    outs = []
    with (
        ExpertStream(path, config) as stream,
        Window(stream, backend=backend) as window,
        window.turn(),
    ):
        for layer, x in enumerate(inputs):
            outs.append(window.moe(layer, x))
    return outs


def relative(a: npt.NDArray[np.float32], b: npt.NDArray[np.float32]) -> float:
    return float(np.abs(a.astype(np.float64) - b).max() / max(float(np.abs(b).max()), 1e-12))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="metal")
    ap.add_argument("--reference", default="cpu")
    ap.add_argument("--formats", nargs="*", help="subset by name, e.g. q4_g64_sbf16 f16")
    ap.add_argument("--rows", type=int, default=7, help="tokens per layer call")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    formats = [f for f in FORMATS if not args.formats or fmt_name(f) in args.formats]
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in formats:
            path = make_pack(Path(tmp) / f"{fmt_name(fmt)}.strpk", fmt)
            rng = np.random.default_rng(1)
            inputs = [rng.standard_normal((args.rows, 256)).astype(np.float32) for _ in range(4)]
            got = run(path, args.backend, 1.0, inputs)
            ref = run(path, args.reference, 1.0, inputs)
            streamed = run(path, args.backend, 0.25, inputs)
            with ExpertPack.open(path) as pack:
                g = pack.geometry
                oracle = [
                    moe_reference(
                        x,
                        pack.router_weights(layer),
                        lambda e, layer=layer: pack.expert_weights(layer, e),
                        g.top_k,
                        g.routing,
                        g.norm_topk_prob,
                    )
                    for layer, x in enumerate(inputs)
                ]
            row = {
                "format": fmt_name(fmt),
                "vs_reference": max(relative(a, b) for a, b in zip(got, ref, strict=True)),
                "vs_oracle": max(relative(a, b) for a, b in zip(got, oracle, strict=True)),
                "i11_bitwise": all(
                    np.array_equal(a, b) for a, b in zip(got, streamed, strict=True)
                ),
            }
            row["ok"] = (
                row["vs_reference"] <= REL_TOL_BACKEND
                and row["vs_oracle"] <= REL_TOL_ORACLE
                and row["i11_bitwise"]
            )
            results.append(row)
            print(
                f"{row['format']:>14}  vs {args.reference} {row['vs_reference']:.2e}  "
                f"vs oracle {row['vs_oracle']:.2e}  I11 {row['i11_bitwise']}  "
                f"{'ok' if row['ok'] else 'FAIL'}"
            )
    summary = {
        "backend": args.backend,
        "reference": args.reference,
        "formats": results,
        "ok": all(r["ok"] for r in results),
    }
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
