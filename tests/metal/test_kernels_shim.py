"""Every Metal kernel, for every pack format, run under the Linux emulator (tests/metal/shim/)
and compared with the CPU backend on the same buffers and with the numpy oracle.

What this proves: the .metal sources, dispatched exactly as the Metal host plans them, compute
the MoE block correctly for every format, resolve experts only through smap or the plan's
snapshot, flag an absent expert instead of reading stale bytes, and give bit-identical results
whether a chunk runs as decode passes (any resident/missing split) or as prompt waves (I11).
What it does not prove: anything about the Metal compiler or a GPU (docs/metal.md).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from metal_fixtures import (  # the two fixtures register under the names harness, format_pack
    FORMATS,
    PackMaker,
    format_id,
    format_pack_fixture,  # noqa: F401
    harness_fixture,  # noqa: F401
)
from shim_build import KERNELS, build_harness

from oracle import OaiExperts, moe_reference, route_reference
from strata_stream.pack import ExpertPack

ROWS, LAYER, SEED = 5, 1, 3
DTYPES: dict[str, Any] = {
    "ids": np.int32,
    "pred1": np.int32,
    "pred2": np.int32,
    "plan": np.uint32,
    "status": np.uint32,
}


class Run:
    def __init__(self, out: Path) -> None:
        self.out = out
        self.x = np.fromfile(out / "x.bin", np.float32)

    def get(self, scenario: str, backend: str, name: str) -> npt.NDArray[Any]:
        return np.fromfile(
            self.out / f"{scenario}.{backend}.{name}.bin", DTYPES.get(name, np.float32)
        )


def run_harness(exe: Path, pack: Path, out: Path) -> Run:
    out.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        [str(exe), str(pack), str(out), str(ROWS), str(LAYER), str(SEED)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    return Run(out)


def close(a: npt.NDArray[Any], b: npt.NDArray[Any], rel: float) -> None:
    scale = max(float(np.abs(b).max()), 1e-6)
    err = float(np.abs(a.astype(np.float64) - b).max())
    assert err <= rel * scale, f"max |diff| {err:.3g} > {rel} * {scale:.3g}"


# gpt-oss's experts (clamped SwiGLU, bf16 Linear biases) in the formats its checkpoints come in.
GPT_OSS = [("q4", 64, "bf16"), ("mxfp4", 32, "e8m0")]
CASES = [(f, False) for f in FORMATS] + [(f, True) for f in GPT_OSS]


@pytest.mark.parametrize(
    ("fmt", "gpt_oss"), CASES, ids=[format_id(f) + ("-gpt_oss" if o else "") for f, o in CASES]
)
def test_kernels_match_cpu_backend_and_oracle(
    fmt: tuple[str, int, str], gpt_oss: bool, harness: Path, format_pack: PackMaker,
    tmp_path: Path,
) -> None:  # fmt: skip
    routing = "topk_softmax" if fmt[0] in ("bf16", "q8") else "softmax_topk"
    pack_path = format_pack(fmt, routing, gpt_oss)
    run = run_harness(harness, pack_path, tmp_path / "out")
    with ExpertPack.open(pack_path) as pack:
        g = pack.geometry
        oai = None
        if gpt_oss:
            assert g.activation == "swiglu_oai" and pack.bias_dtype == "bf16"
            oai = OaiExperts(g.act_alpha, g.act_limit, lambda e: pack.expert_biases(LAYER, e))
        x = run.x.reshape(ROWS, g.hidden)
        router = pack.router_weights(LAYER)
        ids_ref, w_ref = route_reference(x, router, g.top_k, g.routing, g.norm_topk_prob)
        ref = moe_reference(
            x,
            router,
            lambda e: pack.expert_weights(LAYER, e),
            g.top_k,
            g.routing,
            g.norm_topk_prob,
            oai,
        )
        pred_ref = [
            # The harness predicts for layer + d, or repeats layer past the last one.
            route_reference(
                x,
                pack.router_weights(LAYER + d if LAYER + d < g.n_layers else LAYER),
                g.top_k,
                g.routing,
                g.norm_topk_prob,
            )[0]
            for d in (1, 2)
        ]

    # Routing: the same experts as the CPU backend and the oracle, weights to float rounding.
    ids = run.get("decode", "metal", "ids").reshape(ROWS, g.top_k)
    np.testing.assert_array_equal(ids, run.get("decode", "cpu", "ids").reshape(ROWS, g.top_k))
    np.testing.assert_array_equal(ids, ids_ref)
    weights = run.get("decode", "metal", "weights").reshape(ROWS, g.top_k)
    np.testing.assert_allclose(weights, w_ref, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(
        weights, run.get("decode", "cpu", "weights").reshape(ROWS, g.top_k), rtol=1e-5, atol=1e-7
    )
    for d, name in ((0, "pred1"), (1, "pred2")):
        np.testing.assert_array_equal(
            run.get("decode", "metal", name).reshape(ROWS, g.top_k), pred_ref[d]
        )

    # The block: the Metal kernels against the CPU backend and the oracle.
    out = run.get("decode", "metal", "out")
    close(out, run.get("decode", "cpu", "out"), 2e-5)
    close(out, ref.reshape(-1), 1e-4)
    close(run.get("decode", "metal", "h"), run.get("decode", "cpu", "h"), 2e-5)

    # I11 in the emulator: a resident/missing split and the prompt waves give the same bits.
    np.testing.assert_array_equal(run.get("split", "metal", "out"), out)
    np.testing.assert_array_equal(run.get("wave", "metal", "out"), out)
    np.testing.assert_array_equal(run.get("wave", "metal", "y"), run.get("decode", "metal", "y"))
    # The resident pass ran from the plan's snapshot: odd experts were absent when it was made.
    plan = run.get("split", "metal", "plan").reshape(ROWS, g.top_k)
    np.testing.assert_array_equal(plan == 0xFFFFFFFF, ids % 2 == 1)


@pytest.mark.parametrize("fmt", [("q4", 64, "bf16"), ("f16", 64, "f16")], ids=format_id)
def test_absent_expert_is_reported_not_computed(
    fmt: tuple[str, int, str], harness: Path, format_pack: PackMaker, tmp_path: Path
) -> None:
    run = run_harness(harness, format_pack(fmt), tmp_path / "out")
    ids = run.get("absent", "metal", "ids")
    assert (ids % 2 == 1).any(), "the scenario needs an odd (never published) expert routed"
    status = run.get("absent", "metal", "status")
    assert status[0] == 1 and status[1] == LAYER  # STRATA_ERROR_ABSENT, its layer
    assert run.get("absent", "cpu", "status")[0] == 1  # the CPU backend refuses it too
    # No output was computed from an unpublished slot: y rows of odd experts stay zero.
    y = run.get("absent", "metal", "y").reshape(len(ids), -1)
    assert not y[ids % 2 == 1].any()


def test_every_planned_kernel_is_registered(harness: Path) -> None:
    names = set(
        subprocess.run(
            [str(harness), "--list"], capture_output=True, text=True, check=True
        ).stdout.split()
    )
    for fmt in FORMATS:
        suffix = format_id(fmt)
        for kernel in (
            f"gate_up_{suffix}_silu",
            f"gate_up_{suffix}_oai",
            f"down_{suffix}",
            f"moe_gate_up_{suffix}_silu",
            f"moe_gate_up_{suffix}_oai",
            f"moe_down_{suffix}",
        ):
            assert kernel in names
    assert {"route_logits", "route_select", "route_predict", "plan", "combine"} <= names


def test_planted_change_in_a_kernel_source_breaks_parity(
    format_pack: PackMaker, tmp_path: Path, harness: Path
) -> None:
    """The emulator runs the .metal text: flip one sign in a copy of down.metal and parity fails
    (while the unmodified build, the `harness` fixture, passes the tests above)."""
    kernels = tmp_path / "metal" / "kernels"
    shutil.copytree(KERNELS, kernels)
    src = (kernels / "down.metal").read_text()
    needle = "weights[i] * add_bias("
    assert src.count(needle) == 1
    (kernels / "down.metal").write_text(src.replace(needle, "-weights[i] * add_bias("))
    planted = build_harness(kernels, name="shim_harness_planted")
    assert planted != harness
    run = run_harness(planted, format_pack(("q4", 64, "f16")), tmp_path / "out")
    out, cpu = run.get("decode", "metal", "out"), run.get("decode", "cpu", "out")
    with pytest.raises(AssertionError):
        close(out, cpu, 2e-5)
    np.testing.assert_allclose(out, -cpu, rtol=1e-4, atol=1e-5)  # exactly the planted change
