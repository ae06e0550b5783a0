"""strata_stream.transformers on CUDA, the parts checkable without a GPU: the device argument,
the GPU arena budget, and the routed call on device memory refused where it cannot run (the
cpu backend) with every bad array named before anything reaches the engine. The GPU runs are
tests/cuda/test_transformers_cuda.py (marker cuda)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from strata_stream import ExpertPack, ExpertStream, StreamConfig, Window  # noqa: E402
from strata_stream.arena_budget import KV_SHARE, MARGIN_MIN, MARGIN_SHARE, scratch_bytes  # noqa: E402
from strata_stream.convert import convert  # noqa: E402
from strata_stream.errors import ConfigError  # noqa: E402
from strata_stream.transformers import load  # noqa: E402
from strata_stream.transformers.loader import _arena_bytes  # noqa: E402
from strata_stream.transformers.random_model import make_checkpoint  # noqa: E402

BASE = StreamConfig(io_threads=2, direct_io=False, persist_profile=False)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("hf_device")
    path = make_checkpoint("qwen3_moe", root / "qwen3_moe")
    return path, convert(path, root / "qwen3_moe.strpk", progress=False)


def test_the_device_argument_names_what_is_wrong(checkpoint: tuple[Path, Path]) -> None:
    path, pack = checkpoint
    kw: dict[str, Any] = {"pack_path": pack, "config": BASE, "progress": False}
    with pytest.raises(ConfigError, match="runs on CUDA device 0"):
        load(path, device="cuda:1", **kw)
    with pytest.raises(ConfigError, match="runs on the CPU or on CUDA"):
        load(path, device="meta", **kw)
    with pytest.raises(ConfigError, match="device_map: not supported; pass device="):
        load(path, device_map="auto", **kw)
    if not torch.cuda.is_available():  # a GPU machine loads it (tests/cuda)
        with pytest.raises(ConfigError, match="device cuda: this torch sees no CUDA GPU"):
            load(path, device="cuda", **kw)


def test_the_gpu_arena_is_what_gpu_memory_leaves(
    checkpoint: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, pack_path = checkpoint
    gpu = torch.device("cuda", 0)
    free = [0]
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *_: (free[0], 1 << 40))
    with ExpertPack.open(pack_path) as pack:
        stride, everything = pack.record_stride, pack.geometry.n_records * pack.record_stride
        minimum = 2 * pack.geometry.top_k * stride
        free[0] = 1 << 40  # room for everything: every expert resident, as on the host
        assert _arena_bytes(pack, None, gpu, 0) == everything
        # Below the headroom (the margin alone is MARGIN_MIN): the error says how much is needed.
        free[0] = minimum + MARGIN_MIN // 2
        with pytest.raises(ConfigError, match="not enough GPU memory for the experts"):
            _arena_bytes(pack, None, gpu, 0)
        # The headroom is the scratch, KV_SHARE of what is free and a margin of MARGIN_SHARE of
        # it (at least MARGIN_MIN): this much free leaves half the experts' bytes.
        scratch = min(scratch_bytes(pack), everything)
        free[0] = int((everything // 2 + scratch + MARGIN_MIN) / (1 - KV_SHARE)) + 1
        assert MARGIN_SHARE * free[0] < MARGIN_MIN  # the margin is its minimum at this size
        assert abs(_arena_bytes(pack, None, gpu, 0) - everything // 2) <= 2
        free[0] = minimum
        with pytest.raises(ConfigError, match="does not fit in cuda:0"):
            _arena_bytes(pack, everything, gpu, 0)
        assert _arena_bytes(pack, minimum, gpu, 0) == minimum
        assert _arena_bytes(pack, None, torch.device("cpu"), 0) == everything  # host only


class _Cai:
    """An object with a __cuda_array_interface__ (whose pointer no GPU ever sees here)."""

    def __init__(
        self,
        shape: tuple[int, ...],
        typestr: str = "<f4",
        strides: tuple[int, ...] | None = None,
        readonly: bool = False,
    ) -> None:
        self.buf = np.zeros(int(np.prod(shape)) + 16, np.float32)
        self.__cuda_array_interface__ = {
            "shape": shape, "typestr": typestr, "data": (self.buf.ctypes.data, readonly),
            "strides": strides, "version": 2,
        }  # fmt: skip


def test_a_routed_call_on_device_memory_is_refused_by_name(
    checkpoint: tuple[Path, Path],
) -> None:
    _, pack = checkpoint
    with ExpertStream(pack, BASE) as stream, Window(stream, backend="cpu") as w:
        ids = np.array([[0, 1]], np.int32)
        wts = np.ones((1, 2), np.float32)
        x, out = _Cai((1, 64)), _Cai((1, 64))
        bad: list[tuple[Any, Any, str]] = [
            (torch.zeros(1, 64), out, "x must be a CUDA array .* torch.Tensor on cpu"),
            (np.zeros((1, 64), np.float32), out, "x must be a CUDA array"),
            (_Cai((1, 64), "<f2"), out, "x must be float32"),
            (_Cai((1, 32)), out, r"x must have shape \[T, 64\]"),
            (_Cai((2, 64), strides=(4, 8)), _Cai((2, 64)), "x must be C-contiguous"),
            (x, _Cai((1, 64), readonly=True), "out is read-only"),
            (x, _Cai((2, 64)), "out has 2 rows, x has 1"),
            (x, out, "backend 'cpu': the cpu backend reads x from and writes out to host memory"),
        ]
        for xa, oa, match in bad:
            with pytest.raises(ConfigError, match=match):
                w.moe_routed_device(0, xa, ids, wts, oa)
        # A contiguous [1, H] array with any row stride is fine: the check above was the backend.
        with pytest.raises(ConfigError, match="host memory only"):
            w.moe_routed_device(0, _Cai((1, 64), strides=(999, 4)), ids, wts, out)
        # A stream that is no CUDA stream handle is refused before anything else; the cpu
        # backend refuses a call given a good one as without it (it never returns early).
        for stream in (-1, True, 1.5, "0"):
            with pytest.raises(ConfigError, match="stream must be a CUDA stream handle"):
                w.moe_routed_device(0, x, ids, wts, out, stream=stream)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="host memory only"):
            w.moe_routed_device(0, x, ids, wts, out, stream=0)
        assert not w.completion_pending
        # The engine refuses it too, below the Python wrapper (the capability, asked once).
        with pytest.raises(ConfigError, match="the cpu backend reads x from"):
            w._w.moe_routed_device(0, x.buf.ctypes.data, out.buf.ctypes.data, 1, ids, wts)
        with pytest.raises(ValueError, match="must not overlap"):
            w._w.moe_routed_device(0, x.buf.ctypes.data, x.buf.ctypes.data + 4, 1, ids, wts)
        # Nothing was computed or left open: the host path still runs.
        y = w.moe_routed(0, np.ones((1, 64), np.float32), ids, wts)
        assert np.isfinite(y).all() and np.abs(y).max() > 0
