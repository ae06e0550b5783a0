"""Streamed experts under MLX distributed: 2 ranks, `mlx.launch --backend ring` on loopback.

Pipeline on a tiny deepseek_v3 (mlx-lm's `pipeline`), tensor parallel on a tiny qwen3_moe whose
moe_intermediate splits into whole q4 groups per rank. Every rank (rank_script.py) runs plain
sharded mlx-lm and the streamed model on the same group; this side compares with plain
single-process mlx-lm and single-process strata-stream computed here:

- experts="mlx" and experts="cpu" (whose default arithmetic reproduces MLX's CPU kernels):
  bitwise equal to plain sharded mlx-lm (logits and greedy tokens); the pipeline is bitwise
  single-process mlx-lm too (no arithmetic changes), tensor parallel is within the bf16 bounds of
  docs/models.md of it (partial sums added in another order), with the same greedy tokens on
  the MLX path;
- each rank's pack holds its share only (its layers, renumbered; its slice of every expert, byte
  for byte the checkpoint's), and each rank reads its share only: bytes read = misses x its
  record size, the pipeline's ranks together read what one process reads, each tensor rank half;
- the expert tensors are never evaluated by the sharding: overwritten with NaN, same logits.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
mlx_lm = pytest.importorskip("mlx_lm")

import strata_stream  # noqa: E402
from mlx_models import make_checkpoint, poison_experts  # noqa: E402
from strata_stream import ExpertPack, StreamConfig  # noqa: E402
from strata_stream.convert import convert  # noqa: E402
from strata_stream.mlx_lm import load  # noqa: E402
from strata_stream.mlx_lm.launch import launcher, run_ranks  # noqa: E402

HERE = Path(__file__).parent
# The ranks import the strata_stream this process imported (src/ in a checkout, site-packages
# when installed: then src/ has no compiled extension and must not come first).
PACKAGE_ROOT = Path(strata_stream.__file__).resolve().parents[1]
TOKENS = [3, 5, 7, 9, 11, 13, 40, 22, 8, 17]
MAX_TOKENS = 8
TIMEOUT = 240.0
DECISIVE = 0.5  # as tests/test_mlx_lm_families.py: reference top-1 margins that must agree
# As rank_script.py's: no speculative reads, no profile carried between runs.
CFG = StreamConfig(lookahead=False, profile_prefetch=False, persist_profile=False, io_threads=2,
                   direct_io=False)  # fmt: skip
CHECKPOINTS: dict[str, tuple[str, dict[str, Any]]] = {
    # 4 layers, MoE from layer 1 (first_k_dense_replace): each rank of 2 gets MoE layers.
    "pipeline": ("deepseek_v3", {"num_hidden_layers": 4}),
    # moe_intermediate 512 = 2 ranks x 4 groups of 64; 4 heads and 2 KV heads shard evenly.
    "tensor": (
        "qwen3_moe",
        {"moe_intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2},
    ),
    # Shared experts (sharded too, summed with the routed ones before the block's all_sum) and
    # a dense first layer; 4 heads so o_proj's input splits into whole groups.
    "tensor_deepseek": ("deepseek_v3", {"moe_intermediate_size": 512, "num_attention_heads": 4}),
}


def _ring_available() -> str | None:
    if launcher() is None:
        return "mlx.launch is not installed"
    try:
        ring = mx.distributed.is_available(backend="ring")
    except (AttributeError, TypeError):  # an MLX without distributed, or without backends
        ring = False
    if not ring:
        return "MLX's ring backend is not available in this build"
    return None


pytestmark = pytest.mark.skipif(_ring_available() is not None, reason=str(_ring_available()))


def run(model: Any) -> tuple[np.ndarray, list[int]]:
    from mlx_lm.generate import generate_step

    logits = np.array(model(mx.array([TOKENS]))[0].astype(mx.float32))
    steps = generate_step(
        mx.array(TOKENS), model, max_tokens=MAX_TOKENS, sampler=lambda x: mx.argmax(x, axis=-1)
    )
    return logits, [int(t) for t, _ in steps]


class Case:
    """One checkpoint, its single-process references, and a 2-rank launch per experts mode."""

    def __init__(self, case: str, root: Path) -> None:
        family, dims = CHECKPOINTS[case]
        self.mode = case.split("_")[0]
        self.root = root
        self.path = make_checkpoint(family, root / family, dims=dims)
        self.poisoned = root / f"{family}-poisoned"
        shutil.copytree(self.path, self.poisoned)
        poison_experts(self.poisoned)
        self.pack = convert(self.path, root / "whole.strpk", progress=False)
        ref, _ = mlx_lm.load(str(self.path))
        self.ref_logits, self.ref_greedy = run(ref)
        del ref
        self.single: dict[str, dict[str, Any]] = {}
        self.ranks: dict[str, list[dict[str, Any]]] = {}

    def single_process(self, experts: str) -> dict[str, Any]:
        if experts not in self.single:
            model, _ = load(str(self.path), pack_path=self.pack, experts=experts, config=CFG,
                            progress=False)  # fmt: skip
            logits, greedy = run(model)
            total = model.strata_engine.window.stats()["total"]
            self.single[experts] = {"logits": logits, "greedy": greedy, "stats": total}
            model.strata_engine.close()
        return self.single[experts]

    def launch(self, experts: str) -> list[dict[str, Any]]:
        if experts in self.ranks:
            return self.ranks[experts]
        out = self.root / f"out-{experts}"
        out.mkdir()
        args = [str(HERE / "rank_script.py"), "--checkpoint", str(self.path), "--mode",
                self.mode, "--experts", experts, "--out", str(out), "--tokens",
                ",".join(map(str, TOKENS)), "--max-tokens", str(MAX_TOKENS), "--poisoned",
                str(self.poisoned)]  # fmt: skip
        env = {
            "STRATA_CACHE": str(self.root / "cache"),
            "PYTHONPATH": os.pathsep.join([str(PACKAGE_ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        r = run_ranks(args, n=2, timeout=TIMEOUT, env=env)
        assert not r.timed_out, f"ranks timed out after {TIMEOUT} s:\n{r.stdout}\n{r.stderr}"
        assert r.returncode == 0, f"exit {r.returncode}:\n{r.stdout}\n{r.stderr}"
        ranks = [json.loads((out / f"rank{i}.json").read_text()) for i in range(2)]
        self.ranks[experts] = ranks
        return ranks


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Case:
    return Case("pipeline", tmp_path_factory.mktemp("pipeline"))


@pytest.fixture(scope="module")
def tensor(tmp_path_factory: pytest.TempPathFactory) -> Case:
    return Case("tensor", tmp_path_factory.mktemp("tensor"))


@pytest.fixture(scope="module")
def tensor_deepseek(tmp_path_factory: pytest.TempPathFactory) -> Case:
    return Case("tensor_deepseek", tmp_path_factory.mktemp("tensor_deepseek"))


def within_bf16(got: np.ndarray, ref: np.ndarray) -> None:
    """docs/models.md's bounds for bf16 arithmetic in another order: median position within 5%
    of max|logit|, worst within 50%, same top-1 wherever the reference margin exceeds 0.5."""
    scale = float(np.abs(ref).max())
    per_pos = np.abs(got - ref).max(axis=-1) / scale
    assert float(np.median(per_pos)) <= 0.05, per_pos
    assert float(per_pos.max()) <= 0.5, per_pos
    top2 = np.sort(ref, axis=-1)[:, -2:]
    decisive = top2[:, 1] - top2[:, 0] > DECISIVE
    assert decisive.any()
    assert (got.argmax(-1) == ref.argmax(-1))[decisive].all()


def arr(rank: dict[str, Any], key: str) -> np.ndarray:
    return np.array(rank[key], dtype=np.float32)


# ---- pipeline -------------------------------------------------------------------------------


def test_pipeline_mlx_is_bitwise_plain_and_single_process_mlx_lm(pipeline: Case) -> None:
    for rank in pipeline.launch("mlx"):
        assert np.array_equal(arr(rank, "logits"), arr(rank, "plain_logits"))
        assert rank["greedy"] == rank["plain_greedy"]
        assert np.array_equal(arr(rank, "logits"), pipeline.ref_logits)
        assert rank["greedy"] == pipeline.ref_greedy


def test_pipeline_cpu_is_bitwise_plain_sharded_and_single_process(pipeline: Case) -> None:
    # The CPU backend's default arithmetic reproduces MLX's CPU kernels (docs/models.md).
    single = pipeline.single_process("cpu")
    for rank in pipeline.launch("cpu"):
        assert np.array_equal(arr(rank, "logits"), arr(rank, "plain_logits"))
        assert rank["greedy"] == rank["plain_greedy"]
        assert np.array_equal(arr(rank, "logits"), single["logits"])
        assert rank["greedy"] == single["greedy"]
        assert np.array_equal(arr(rank, "logits"), pipeline.ref_logits)


def test_pipeline_rank_packs_hold_only_their_layers(pipeline: Case) -> None:
    ranks = pipeline.launch("mlx")
    with ExpertPack.open(pipeline.pack) as whole:
        all_layers = whole.metadata["model"]["decoder_layers"]
        seen: list[int] = []
        for rank in ranks:
            p = rank["pack"]
            start, end = p["model"]["share"]["layers"]
            local = [d for d in all_layers if start <= d < end]
            assert rank["local_moe_layers"] == local and p["model"]["decoder_layers"] == local
            assert (
                p["n_layers"] == len(local)
                and p["moe_intermediate"] == whole.geometry.moe_intermediate
            )
            n_e = whole.geometry.n_experts
            assert p["file_bytes"] == p["records_offset"] + len(local) * n_e * p["record_stride"]
            with ExpertPack.open(p["path"]) as part:
                for pack_layer, decoder in enumerate(local):
                    for e in range(n_e):
                        assert part.read_record(pack_layer, e) == whole.read_record(
                            all_layers.index(decoder), e
                        )
            seen += local
        assert sorted(seen) == all_layers  # the ranks' shares partition the model's layers


def test_pipeline_ranks_read_their_layers_only(pipeline: Case) -> None:
    for experts in ("mlx", "cpu"):
        single = pipeline.single_process(experts)["stats"]
        ranks = pipeline.launch(experts)
        for rank in ranks:
            s = rank["stats"]
            assert s["bytes_read"] == s["misses"] * rank["pack"]["record_bytes"]
            assert s["misses"] > 0
        # Together the ranks read exactly what one process reads, each its own layers'.
        assert sum(r["stats"]["misses"] for r in ranks) == single["misses"]
        assert sum(r["stats"]["bytes_read"] for r in ranks) == single["bytes_read"]
        assert ranks[0]["summed"]["bytes_read"] == single["bytes_read"]
        assert ranks[0]["summed"]["misses"] == single["misses"]


# ---- tensor parallel ------------------------------------------------------------------------


def test_tensor_mlx_is_bitwise_plain_sharded_and_near_single_process(tensor: Case) -> None:
    for rank in tensor.launch("mlx"):
        assert np.array_equal(arr(rank, "logits"), arr(rank, "plain_logits"))
        assert rank["greedy"] == rank["plain_greedy"]
        within_bf16(arr(rank, "logits"), tensor.ref_logits)
        assert rank["greedy"] == tensor.ref_greedy


def test_tensor_cpu_is_bitwise_plain_sharded(tensor: Case) -> None:
    for rank in tensor.launch("cpu"):
        assert np.array_equal(arr(rank, "logits"), arr(rank, "plain_logits"))
        assert rank["greedy"] == rank["plain_greedy"]
        within_bf16(arr(rank, "logits"), tensor.ref_logits)


def test_tensor_deepseek_shared_experts_summed_where_mlx_lm_sums(tensor_deepseek: Case) -> None:
    """The CPU path's block applies the all_sum itself: after the (sharded) shared experts, as
    DeepseekV3MoE does. Summed anywhere else the partial outputs would be far off."""
    case = tensor_deepseek
    for rank in case.launch("mlx"):
        assert np.array_equal(arr(rank, "logits"), arr(rank, "plain_logits"))
        assert rank["greedy"] == rank["plain_greedy"]
    for rank in case.launch("cpu"):
        assert np.array_equal(arr(rank, "logits"), arr(rank, "plain_logits"))
        assert rank["greedy"] == rank["plain_greedy"]
        within_bf16(arr(rank, "logits"), case.ref_logits)


def test_tensor_rank_packs_hold_only_their_slice(tensor: Case) -> None:
    ranks = tensor.launch("mlx")
    with ExpertPack.open(tensor.pack) as whole:
        g = whole.geometry
        part_i = g.moe_intermediate // 2
        for rank in ranks:
            p = rank["pack"]
            r = p["model"]["share"]["tp_rank"]
            assert p["model"]["share"] == {"layers": None, "tp_rank": r, "tp_size": 2}
            assert p["moe_intermediate"] == part_i and p["n_layers"] == g.n_layers
            assert 2 * p["record_bytes"] == whole.record_bytes
            assert 2 * p["record_stride"] == whole.record_stride
            rows = slice(r * part_i, (r + 1) * part_i)
            groups = slice(r * part_i // whole.group_size, (r + 1) * part_i // whole.group_size)
            words = slice(r * part_i // 8, (r + 1) * part_i // 8)  # q4: 8 values per word
            with ExpertPack.open(p["path"]) as part:
                for layer in range(g.n_layers):
                    for e in range(g.n_experts):
                        full = whole.stored_weights(layer, e)
                        mine = part.stored_weights(layer, e)
                        for m in (0, 1):
                            assert np.array_equal(mine[m].weight, full[m].weight[rows])
                            assert np.array_equal(mine[m].scales, full[m].scales[rows])
                            assert np.array_equal(mine[m].biases, full[m].biases[rows])
                        assert np.array_equal(mine[2].weight, full[2].weight[:, words])
                        assert np.array_equal(mine[2].scales, full[2].scales[:, groups])
                        assert np.array_equal(mine[2].biases, full[2].biases[:, groups])


def test_tensor_ranks_each_read_half(tensor: Case) -> None:
    for experts in ("mlx", "cpu"):
        ranks = tensor.launch(experts)
        for rank in ranks:
            s = rank["stats"]
            assert s["bytes_read"] == s["misses"] * rank["pack"]["record_bytes"]
            assert 2 * rank["stats"]["arena_bytes"] == _whole_records(tensor)
        # Every rank routes the same (replicated gate, identical hidden state), so each fetches
        # the same experts: its slices.
        assert ranks[0]["stats"]["misses"] == ranks[1]["stats"]["misses"] > 0
        assert ranks[0]["summed"]["bytes_read"] == sum(r["stats"]["bytes_read"] for r in ranks)
    single = tensor.single_process("mlx")["stats"]
    for rank in tensor.launch("mlx"):  # same greedy tokens as one process: same experts
        assert rank["stats"]["misses"] == single["misses"]
        assert 2 * rank["stats"]["bytes_read"] == single["bytes_read"]


def _whole_records(case: Case) -> int:
    with ExpertPack.open(case.pack) as whole:
        return whole.n_records * whole.record_stride


# ---- what MLX never reads -------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["pipeline", "tensor"])
def test_sharding_never_evaluates_the_expert_tensors(
    mode: str, request: pytest.FixtureRequest
) -> None:
    case: Case = request.getfixturevalue(mode)
    for experts in ("mlx", "cpu"):
        for rank in case.launch(experts):
            poisoned = arr(rank, "poisoned_logits")
            assert np.isfinite(poisoned).all()
            assert np.array_equal(poisoned, arr(rank, "logits"))


# ---- the command line under mlx.launch ------------------------------------------------------


@pytest.mark.parametrize("mode", ["pipeline", "tensor"])
def test_generate_command_under_mlx_launch(mode: str, request: pytest.FixtureRequest) -> None:
    """`strata-stream generate --pipeline|--tensor`: every rank exits 0, only rank 0 prints (the
    text once, a line per rank, their sum), and the text is plain mlx-lm's greedy text."""
    from mlx_lm import generate

    case: Case = request.getfixturevalue(mode)
    prompt = "w1 w2 w3 w4 w5"
    ref, tokenizer = mlx_lm.load(str(case.path))
    want = generate(ref, tokenizer, prompt, max_tokens=6)
    del ref
    env = {
        "STRATA_CACHE": str(case.root / "cache"),
        "PYTHONPATH": os.pathsep.join([str(PACKAGE_ROOT), os.environ.get("PYTHONPATH", "")]),
        "STRATA_LOOKAHEAD": "0",
    }
    args = ["-m", "strata_stream.cli", "generate", str(case.path), "--prompt", prompt,
            "--max-tokens", "6", "--experts", "mlx", f"--{mode}"]  # fmt: skip
    r = run_ranks(args, n=2, timeout=TIMEOUT, env=env)
    assert not r.timed_out and r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    lines = r.stdout.splitlines()
    assert lines.count(want) == 1, (want, r.stdout)
    assert sum(line.startswith("rank 0 ") for line in lines) == 1
    assert sum(line.startswith("rank 1 ") for line in lines) == 1
    assert sum(line.startswith("all 2 ") for line in lines) == 1


# ---- the server under mlx.launch ------------------------------------------------------------


@pytest.mark.parametrize("mode", ["pipeline", "tensor"])
def test_serve_under_mlx_launch(mode: str, request: pytest.FixtureRequest) -> None:
    """`strata-stream serve --pipeline|--tensor`: rank 0 answers HTTP, the follower runs every
    request in step (a sampled request between two greedy ones leaves them in step: the second
    greedy answer is still plain mlx-lm's); clients served at once share the batch rank 0
    broadcasts, each getting plain mlx-lm's text; when rank 0 stops the follower returns."""
    import signal
    import time
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    from mlx_lm import generate

    from strata_stream.mlx_lm.launch import free_port_range, kill_ranks, rank_pids, start_ranks

    case: Case = request.getfixturevalue(mode)
    prompt = "w1 w2 w3 w4 w5"
    ref, tokenizer = mlx_lm.load(str(case.path))
    want = generate(ref, tokenizer, prompt, max_tokens=6)
    together = ["w1 w2 w3 w4 w5", "w3 w1", "w2 w2 w5 w4", "w5"]
    want_together = [generate(ref, tokenizer, p, max_tokens=8) for p in together]
    del ref
    port = free_port_range(1)
    env = {
        "STRATA_CACHE": str(case.root / "cache"),
        "PYTHONPATH": os.pathsep.join([str(PACKAGE_ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    args = ["-m", "strata_stream.cli", "serve", str(case.path), "--port", str(port),
            f"--{mode}", "--experts", "mlx", "--model-id", "m"]  # fmt: skip
    launch = start_ranks(args, n=2, env=env)
    url = f"http://127.0.0.1:{port}"

    def post(body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=60) as r:
            answer: dict[str, Any] = json.loads(r.read())
            return answer

    try:
        deadline = time.monotonic() + TIMEOUT
        while True:
            assert launch.poll() is None, "the launch ended before serving"
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        greedy = {"model": "m", "prompt": prompt, "max_tokens": 6, "temperature": 0}
        assert post(greedy)["choices"][0]["text"] == want
        post({**greedy, "temperature": 1.0, "seed": 7, "max_tokens": 5})
        post({**greedy, "temperature": 1.0, "max_tokens": 3})  # no seed: rank 0 picks one
        assert post(greedy)["choices"][0]["text"] == want
        with ThreadPoolExecutor(len(together)) as pool:
            texts = list(pool.map(lambda p: post({**greedy, "prompt": p, "max_tokens": 8})
                                  ["choices"][0]["text"], together))  # fmt: skip
        assert texts == want_together
        pids = rank_pids(launch)
        assert sorted(pids) == [0, 1], pids
        os.kill(pids[0], signal.SIGINT)  # rank 0 alone: the follower must learn it from rank 0
        out, err = launch.communicate(timeout=60)
        assert "rank 1: rank 0 stopped after 8 requests" in out + err, out + err
    finally:
        kill_ranks(launch)


def test_pipeline_rank_without_moe_layers(tmp_path: Path) -> None:
    """3 deepseek_v3 layers over 2 ranks: rank 1 gets layer 0 alone, which is dense (MoE from
    layer 1): it has no pack and no engine, and still runs its part; rank 0 streams layers 1-2."""
    from mlx_lm import generate

    path = make_checkpoint("deepseek_v3", tmp_path / "ds3", dims={"num_hidden_layers": 3})
    prompt = "w1 w2 w3 w4 w5"
    ref, tokenizer = mlx_lm.load(str(path))
    want = generate(ref, tokenizer, prompt, max_tokens=6)
    del ref
    env = {
        "STRATA_CACHE": str(tmp_path / "cache"),
        "PYTHONPATH": os.pathsep.join([str(PACKAGE_ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    args = ["-m", "strata_stream.cli", "generate", str(path), "--prompt", prompt,
            "--max-tokens", "6", "--experts", "mlx", "--pipeline"]  # fmt: skip
    r = run_ranks(args, n=2, timeout=TIMEOUT, env=env)
    assert not r.timed_out and r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    lines = r.stdout.splitlines()
    assert lines.count(want) == 1, (want, r.stdout)
    rank1 = [line for line in lines if line.startswith("rank 1 ")]
    assert rank1 == ["rank 1  hit rate n/a, 0 bytes read, 0 expert reads"], r.stdout
    packs = sorted(p.name for p in (tmp_path / "cache" / "packs").glob("*.strpk"))
    assert len(packs) == 1 and packs[0].endswith("-pp1-3.strpk"), packs
