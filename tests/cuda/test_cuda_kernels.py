"""The decode kernels' own rules on the device (docs/cuda.md).

Routing over more experts than one block computes: a token's logits are spread over several
blocks and the last of them takes the top-k, which must still break ties to the lower index (the
routers here repeat each row for two experts, so their logits are exactly equal, and an odd top-k
makes the last pick a tie) and match the CPU backend. And issue 19's batch-size rule: a token's
output is the same bits alone (rows below 8: the decode kernels, rows read straight from the
arena; for bf16 the tensor-core kernels' decode tiling) and inside a batch (the staged kernels;
bf16: the prompt tiling), for a row length the 16-byte loads take whole and for one they do not,
and for bf16 groups of more tokens than the tensor-core kernels take in one pass of their blocks,
and passes of more work items (group, row tile, chunk) than the wgmma kernels' grid has blocks.
Each bf16 test takes the family STRATA_CUDA_BF16 names (tests/cuda/device_run.sh runs them under
both).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from strata_stream import ExpertPack, ExpertStream, StreamConfig, Window
from strata_stream.pack import Geometry, write_pack
from strata_stream.pack.quant import bf16_bits_to_f32, f32_to_bf16_bits

from .test_cuda_backend import _experts, max_violation

LAYERS, EXPERTS, TOP_K = 2, 80, 7  # 80 experts: three blocks of logits, the last one partial

cuda = pytest.mark.cuda


def tied_pack(tmp: Path, hidden: int, fmt: str) -> Path:
    g = Geometry(LAYERS, EXPERTS, TOP_K, hidden, 64, "softmax_topk", True)
    rng = np.random.default_rng(5)
    routers = [
        np.repeat(rng.standard_normal((EXPERTS // 2, hidden)).astype(np.float32), 2, axis=0)
        for _ in range(LAYERS)
    ]
    path = tmp / f"tied-{hidden}-{fmt}.strpk"
    write_pack(path, g, routers, _experts(g, 0, False), weight_format=fmt, group_size=64,
               scale_dtype="f16", progress=False)  # fmt: skip
    return path


def all_resident(path: Path, **kw: object) -> StreamConfig:
    with ExpertPack.open(path) as p:
        stride = p.record_stride
    base: dict[str, object] = dict(arena_bytes=LAYERS * EXPERTS * stride, io_threads=2,
                                   direct_io=False, persist_profile=False)  # fmt: skip
    base.update(kw)
    return StreamConfig(**base)  # type: ignore[arg-type]


def run(path: Path, xs: list[list[np.ndarray]], backend: str) -> list[np.ndarray]:
    out = []
    with ExpertStream(path, all_resident(path)) as stream, Window(stream, backend=backend) as w:
        for turn in xs:
            with w.turn():
                out.extend(w.moe(layer, x) for layer, x in enumerate(turn))
    return out


@cuda
@pytest.mark.parametrize(("hidden", "fmt"), [(256, "q4"), (100, "bf16")])
def test_routing_over_many_experts_matches_the_cpu_with_ties_to_the_lower_index(
    tmp_path: Path, hidden: int, fmt: str
) -> None:
    path = tied_pack(tmp_path, hidden, fmt)
    rng = np.random.default_rng(3)
    xs = [[rng.standard_normal((t, hidden)).astype(np.float32) for _ in range(LAYERS)]
          for t in (1, 13, 2)]  # fmt: skip
    assert max_violation(run(path, xs, "cuda"), run(path, xs, "cpu")) <= 1.0


@cuda
@pytest.mark.parametrize(("hidden", "fmt"), [(256, "q4"), (256, "bf16"), (100, "bf16")])
def test_a_token_has_the_same_bits_alone_and_in_a_batch(
    tmp_path: Path, hidden: int, fmt: str
) -> None:
    path = tied_pack(tmp_path, hidden, fmt)
    rng = np.random.default_rng(4)
    batch = [rng.standard_normal((64, hidden)).astype(np.float32) for _ in range(LAYERS)]
    alone, three, many = (run(path, [[x[:t] for x in batch]], "cuda") for t in (1, 3, 64))
    for a, b, c in zip(alone, three, many, strict=True):
        assert np.array_equal(a[0], c[0]) and np.array_equal(b, c[:3])


def check_bf16_batch_rule(path: Path, g: Geometry, rows: int, seed: int, expert_seed: int) -> None:
    """A bf16 pack of geometry g at `path`: a token's bits the same alone, in 3 rows and in
    `rows`, and the `rows` within the CPU bound."""
    rng = np.random.default_rng(seed)
    routers = [
        rng.standard_normal((g.n_experts, g.hidden)).astype(np.float32) for _ in range(LAYERS)
    ]
    write_pack(path, g, routers, _experts(g, expert_seed, False), weight_format="bf16",
               progress=False)  # fmt: skip
    batch = [rng.standard_normal((rows, g.hidden)).astype(np.float32) for _ in range(LAYERS)]
    alone, three, many = (run(path, [[x[:t] for x in batch]], "cuda") for t in (1, 3, rows))
    for a, b, c in zip(alone, three, many, strict=True):
        assert np.array_equal(a[0], c[0]) and np.array_equal(b, c[:3])
    assert max_violation(many, run(path, [batch], "cpu")) <= 1.0


@cuda
@pytest.mark.parametrize("rows", [1000, 1024])
def test_bf16_groups_of_many_chunks_keep_a_tokens_bits_and_match_the_cpu(
    tmp_path: Path, rows: int
) -> None:
    """4 experts, top-3: about 3/4 of the rows a group, so each of the 8 blocks that share a
    (group, row tile) takes several chunks in turn (1000 rows: the prompt kernels' small tiling,
    chunks of 32; 1024, the whole default chunk: the large one, chunks of 64)."""
    g = Geometry(LAYERS, 4, 3, 256, 64, "softmax_topk", True)
    check_bf16_batch_rule(tmp_path / "chunks-bf16.strpk", g, rows, seed=6, expert_seed=1)


@cuda
@pytest.mark.parametrize("rows", [1000, 1024])
def test_bf16_blocks_of_many_items_keep_a_tokens_bits_and_match_the_cpu(
    tmp_path: Path, rows: int
) -> None:
    """16 experts, top-8, rows of 384 columns: more work items (group, row tile, chunk) than the
    wgmma kernels' persistent grid has blocks, so each block takes several in turn and gate_up's
    rows (6 k-stages) are long enough for a block's ring to run on from one item into the next;
    on the mma.sync family, many chunks a group at both tilings' row counts."""
    g = Geometry(LAYERS, 16, 8, 384, 256, "softmax_topk", True)
    check_bf16_batch_rule(tmp_path / "items-bf16.strpk", g, rows, seed=7, expert_seed=2)


@cuda
@pytest.mark.parametrize("hidden", [256, 384])
def test_bf16_x_values_take_one_piece_with_the_bits_of_three(tmp_path: Path, hidden: int) -> None:
    """x of bf16 values (a bf16 model's activations): gate_up's prompt kernels multiply x's hi
    pieces alone (pieces.cuh). The bits, the sign of a zero included (a row of +0, a row of -0),
    must be those of three pieces: the same rows beside one row off the bf16 grid (which makes
    the pass take three), and the first three alone (the decode tiling, which splits in shared
    memory); and within the CPU bound."""
    g = Geometry(LAYERS, 16, 8, hidden, 128, "softmax_topk", True)
    path = tmp_path / f"bf16-x-{hidden}.strpk"
    rng = np.random.default_rng(8)
    routers = [rng.standard_normal((g.n_experts, hidden)).astype(np.float32) for _ in range(LAYERS)]
    write_pack(path, g, routers, _experts(g, 3, False), weight_format="bf16", progress=False)

    def bf16_values(a: np.ndarray) -> np.ndarray:  # round to nearest even, as float32
        return bf16_bits_to_f32(f32_to_bf16_bits(a))

    batch = [bf16_values(rng.standard_normal((40, hidden))) for _ in range(LAYERS)]
    for x in batch:
        x[0], x[1] = 0.0, -0.0
    off_grid = [rng.standard_normal((1, hidden)).astype(np.float32) for _ in range(LAYERS)]
    one = run(path, [batch], "cuda")
    three = run(path, [[np.vstack([x, o]) for x, o in zip(batch, off_grid, strict=True)]], "cuda")
    alone = run(path, [[x[:3] for x in batch]], "cuda")
    for a, t, d in zip(one, three, alone, strict=True):
        assert np.array_equal(a.view(np.uint32), t[:-1].view(np.uint32))
        assert np.array_equal(a[:3].view(np.uint32), d.view(np.uint32))
    assert max_violation(one, run(path, [batch], "cpu")) <= 1.0
