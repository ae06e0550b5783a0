"""The cuda backend and pack format version 4: its kernels compute the gated swiglu and
swiglu_oai only, so a pack of another activation, or of gateless experts, is refused in one line
naming it (backend="cuda"), and backend="auto" takes the cpu backend for it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from strata_stream import ExpertStream, StreamConfig, Window
from strata_stream.errors import ConfigError
from strata_stream.pack import Geometry, write_pack

cuda = pytest.mark.cuda
L, E, K, H, INTER = 2, 8, 2, 64, 32


def _pack(tmp_path: Path, activation: str, alpha: float, limit: float) -> Path:
    gated = activation != "relu2"
    g = Geometry(L, E, K, H, INTER, "external", True, activation=activation, act_alpha=alpha,
                 act_limit=limit, gated=gated)  # fmt: skip

    def experts(layer: int, expert: int) -> tuple[np.ndarray | None, ...]:
        rng = np.random.default_rng((layer, expert))
        mats = [rng.standard_normal(s).astype(np.float32) for s in g.matrix_shapes()]
        return (mats[0] if gated else None, mats[1], mats[2])

    path = tmp_path / f"{activation}.strpk"
    write_pack(path, g, None, experts, weight_format="f32", progress=False)
    return path


@cuda
@pytest.mark.parametrize(
    ("activation", "alpha", "limit", "message"),
    [
        ("swiglu_clamp", 0.0, 7.0, "activations swiglu and swiglu_oai only; this pack's is "
                                   "swiglu_clamp"),
        ("geglu_tanh", 0.0, 0.0, "this pack's is geglu_tanh"),
        ("swiglu_softcap", 4.0, 25.0, "this pack's is swiglu_softcap"),
        ("relu2", 0.0, 0.0, "gated experts .* only; this pack's have no gate"),
    ],
)  # fmt: skip
def test_the_cuda_backend_refuses_kinds_it_does_not_compute(
    tmp_path: Path, activation: str, alpha: float, limit: float, message: str
) -> None:
    path = _pack(tmp_path, activation, alpha, limit)
    config = StreamConfig(arena_bytes=64 << 20, io_threads=1, direct_io=False)
    with ExpertStream(path, config) as stream:
        with pytest.raises(ConfigError, match=f"backend 'cuda': the cuda backend .*{message}"):
            Window(stream, backend="cuda")
        with Window(stream, backend="auto") as w:
            assert w.stats()["backend"] == "cpu"
