"""strata_stream.transformers.load(device="cuda"): the dense layers in torch on the GPU, the
routed experts on the cuda backend reading x from and writing y into torch CUDA tensors.

For each family, against plain `AutoModelForCausalLM.from_pretrained` on CUDA on the same tiny
random checkpoint (tests/test_transformers_families.py's builders; eager attention and experts):
- float32: the dense layers are the same torch kernels on the same inputs, and the experts the
  same float32 equations accumulated in another order (the cuda backend's fixed dot order,
  docs/cuda.md, against cuBLAS's), so teacher-forced logits are within 1e-5 of max|logit|, the
  top-1 agrees where its margin exceeds twice that, and generate gives the same tokens, greedy
  and sampled;
- bfloat16: transformers' eager experts round every intermediate to bfloat16, the backend once
  (x widened to float32 in torch, the output rounded to bfloat16 in torch): within twice
  transformers' own bfloat16-vs-float32 difference on the same weights, decisive tokens agree;
- bitwise the same across arena sizes, lookahead on/off, split turns and prompt chunking (I11);
- poisoned (NaN) expert tensors in the shards change nothing: torch never reads them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from strata_stream.errors import ConfigError  # noqa: E402
from strata_stream.transformers import describe, load  # noqa: E402
from strata_stream.transformers.random_model import CONFIGS  # noqa: E402
from test_transformers_families import (  # noqa: E402
    BASE,
    Family,
    logits,
    test_an_arena_of_every_expert_is_filled_at_load,
    test_bfloat16_within_transformers_own_bf16_rounding,
    test_float32_logits_and_generate_match_plain_transformers,
    test_streamed_output_identical_across_configs,
    test_torch_never_reads_the_expert_tensors,
)

pytestmark = pytest.mark.cuda

# The families module's device-neutral tests, collected here again with this module's fixtures:
# `fam` and `fam_bf16` below load on CUDA, and its oracle is plain transformers on CUDA.
__all__ = [
    "test_an_arena_of_every_expert_is_filled_at_load",
    "test_bfloat16_within_transformers_own_bf16_rounding",
    "test_float32_logits_and_generate_match_plain_transformers",
    "test_streamed_output_identical_across_configs",
    "test_torch_never_reads_the_expert_tensors",
]

FAMILIES = list(CONFIGS)
CUDA = "cuda"


@pytest.fixture(scope="module", params=FAMILIES)
def fam(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Family:
    return Family(request.param, tmp_path_factory.mktemp("hf_cuda"), "float32", CUDA)


@pytest.fixture(scope="module", params=FAMILIES)
def fam_bf16(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Family:
    return Family(request.param, tmp_path_factory.mktemp("hf_cuda_bf16"), "bfloat16", CUDA)


def test_dense_on_the_gpu_experts_on_the_cuda_backend(fam: Family, closing: list[Any]) -> None:
    model = fam.load()
    closing.append(model)
    assert {p.device.type for p in model.parameters()} == {"cuda"}
    assert not [n for n, _ in model.named_parameters() if ".experts." in n]
    stats = describe(model)
    assert stats["backend"] == "cuda" and stats["device"] == "cuda:0"


@pytest.mark.parametrize("fam", ["qwen3_moe"], indirect=True)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_routed_call_reads_x_in_place_and_matches_the_cpu_backend(
    fam: Family, dtype: str, closing: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = fam.load(lookahead=False)
    closing.append(model)
    engine = model.strata_engine
    seen: list[tuple[int, str, str, int | None]] = []
    real = engine.window.moe_routed_device

    def spy(layer: int, x: Any, ids: Any, w: Any, out: Any, *args: Any, **kw: Any) -> None:
        seen.append((x.data_ptr(), str(x.device), str(out.device), kw.get("stream")))
        real(layer, x, ids, w, out, *args, **kw)

    monkeypatch.setattr(engine.window, "moe_routed_device", spy)
    gen = torch.Generator().manual_seed(1)
    x_cpu = torch.randn(5, 64, generator=gen).to(getattr(torch, dtype))
    ids = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7], [1, 6]])
    w = torch.rand(5, 2, generator=gen)
    x = x_cpu.to(CUDA)
    y = engine.run(0, x, ids.to(CUDA), w.to(CUDA))
    assert y.device == x.device and y.dtype == x.dtype and y.shape == x.shape
    if dtype == "float32":
        assert seen[0][0] == x.data_ptr()  # read in place: no copy of x
    # torch's stream waits for the experts: the call returned with its kernels queued.
    assert seen[0][1:] == ("cuda:0", "cuda:0", torch.cuda.current_stream().cuda_stream)
    assert engine.window.completion_pending
    cpu = load(fam.path, pack_path=fam.pack, config=BASE.replace(lookahead=False),
               progress=False)  # fmt: skip
    closing.append(cpu)
    want = cpu.strata_engine.run(0, x_cpu, ids, w).float().numpy()
    got = y.float().cpu().numpy()
    if dtype == "float32":
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max() + 1e-6
    else:  # both rounded once to bfloat16 from float32 results 1e-5 apart: one step at most
        assert np.abs(got - want).max() <= 2.0**-7 * np.abs(want).max()


class _FakeCuda:
    """A __cuda_array_interface__ over host memory: the backend must refuse its pointer."""

    def __init__(self, a: np.ndarray) -> None:
        self.a = a
        self.__cuda_array_interface__ = {
            "shape": a.shape, "typestr": "<f4", "data": (a.ctypes.data, False),
            "strides": None, "version": 2,
        }  # fmt: skip


@pytest.mark.parametrize("fam", ["qwen3_moe"], indirect=True)
def test_bad_device_inputs_name_their_cause(fam: Family, closing: list[Any]) -> None:
    model = fam.load()
    closing.append(model)
    engine = model.strata_engine
    window = engine.window
    ids = np.array([[0, 1]], np.int32)
    w = np.ones((1, 2), np.float32)
    x = torch.zeros(1, 64, device=CUDA)
    out = torch.empty(1, 64, device=CUDA)
    with pytest.raises(ConfigError, match="x must be a CUDA array"):
        window.moe_routed_device(0, x.cpu(), ids, w, out)
    with pytest.raises(ConfigError, match="float32"):
        window.moe_routed_device(0, x.half(), ids, w, out)
    with pytest.raises(ConfigError, match="C-contiguous"):
        window.moe_routed_device(0, torch.zeros(64, 2, device=CUDA).t(), ids, w, out)
    host = np.zeros((1, 64), np.float32)
    with pytest.raises(ConfigError, match="x is host memory"):
        window.moe_routed_device(0, _FakeCuda(host), ids, w, out)
    with pytest.raises(ConfigError, match="out is host memory"):
        window.moe_routed_device(0, x, ids, w, _FakeCuda(host))
    # The stream and the Window stay usable after each refusal.
    window.restart_pass()
    x1 = x + 1
    torch.cuda.synchronize()  # the caller's part of the contract: x is complete (docstring)
    window.moe_routed_device(0, x1, ids, w, out)
    assert torch.isfinite(out).all() and out.abs().max() > 0
    window.restart_pass()
    with pytest.raises(ConfigError, match="streamed experts run on cuda:0"):
        engine.run(0, torch.zeros(1, 64), torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2))


@pytest.mark.parametrize("fam", ["mixtral"], indirect=True)
def test_the_arena_is_sized_from_gpu_memory(fam: Family, closing: list[Any]) -> None:
    model = load(fam.path, pack_path=fam.pack, config=BASE, device=CUDA, progress=False)
    closing.append(model)
    # Tiny experts: every one resident, whichever of host and GPU memory bounds it.
    assert model.strata_engine.config.arena_bytes == fam.n_records * fam.stride
    assert np.abs(logits(model) - fam.ref_logits).max() <= 1e-5 * np.abs(fam.ref_logits).max()
