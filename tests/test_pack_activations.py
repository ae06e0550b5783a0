"""Format version 4: the activations beyond SwiGLU and gpt-oss's, and gateless experts.

Each kind is computed by the cpu backend (Window.moe_routed) and checked against a numpy oracle
written from the formula in docs/pack-format.md, in float64; the header round-trips through the
engine's parser (version 4 only where a pack needs it), and a header that claims a kind its
version does not know is refused by name.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from strata_stream import ExpertStream, StreamConfig, Window
from strata_stream.errors import ConfigError, PackError
from strata_stream.pack import ExpertPack, Geometry, write_pack
from strata_stream.pack.header import LAYOUT_FLAGS_OFFSET, LayerFormat, MatrixFormat

L, E, K, H, INTER = 2, 8, 2, 64, 32
F64 = npt.NDArray[np.float64]
# (activation, act_alpha, act_limit, gated) for every version 4 kind.
KINDS = [
    ("swiglu_clamp", 0.0, 0.75, True),
    ("geglu_tanh", 0.0, 0.0, True),
    ("swiglu_softcap", 1.5, 0.5, True),
    ("relu2", 0.0, 0.0, False),
]


def _geometry(activation: str, alpha: float, limit: float, gated: bool) -> Geometry:
    return Geometry(L, E, K, H, INTER, "external", True, activation=activation,
                    act_alpha=alpha, act_limit=limit, gated=gated)  # fmt: skip


def _pack(tmp_path: Path, g: Geometry, fmt: str = "f32",
          layer_formats: tuple[LayerFormat, ...] = ()) -> Path:  # fmt: skip
    def experts(layer: int, expert: int) -> tuple[np.ndarray | None, ...]:
        rng = np.random.default_rng((layer, expert))
        gate = (rng.standard_normal((INTER, H)) / 2).astype(np.float32)
        up = (rng.standard_normal((INTER, H)) / 2).astype(np.float32)
        down = (rng.standard_normal((H, INTER)) / 4).astype(np.float32)
        return (gate if g.gated else None, up, down)

    path = tmp_path / f"{g.activation}-{fmt}.strpk"
    write_pack(path, g, None, experts, weight_format=fmt, group_size=32, scale_dtype="bf16",
               progress=False, layer_formats=layer_formats)  # fmt: skip
    return path


def _act(g: Geometry, a: F64, u: F64) -> F64:
    """The formula of docs/pack-format.md, "Activations"."""
    h: F64
    if g.activation == "swiglu_clamp":
        a = np.minimum(a, g.act_limit)
        u = np.clip(u, -g.act_limit, g.act_limit)
        h = a / (1 + np.exp(-a)) * u
    elif g.activation == "geglu_tanh":
        h = 0.5 * a * (1 + np.tanh(np.sqrt(2 / np.pi) * (a + 0.044715 * a**3))) * u
    elif g.activation == "swiglu_softcap":
        cap_g = np.tanh(a / g.act_alpha) * g.act_alpha
        cap_u = np.tanh(u / g.act_limit) * g.act_limit
        h = cap_g / (1 + np.exp(-a)) * cap_u
    else:
        assert g.activation == "relu2"
        h = np.maximum(u, 0) ** 2
    return h


def _oracle(pack: ExpertPack, layer: int, x: np.ndarray, ids: np.ndarray, w: np.ndarray) -> F64:
    g = pack.geometry
    out = np.zeros(x.shape, np.float64)
    for t in range(x.shape[0]):
        for j in range(K):
            gate, up, down = (m.astype(np.float64) for m in pack.expert_weights(layer, ids[t, j]))
            a = gate @ x[t] if g.gated else np.zeros(INTER)
            out[t] += w[t, j] * (down @ _act(g, a, up @ x[t]))
    return out


@pytest.mark.parametrize(("activation", "alpha", "limit", "gated"), KINDS)
@pytest.mark.parametrize("fmt", ["f32", "q4"])
def test_each_kind_matches_its_formula(
    tmp_path: Path, activation: str, alpha: float, limit: float, gated: bool, fmt: str
) -> None:
    g = _geometry(activation, alpha, limit, gated)
    path = _pack(tmp_path, g, fmt)
    rng = np.random.default_rng(7)
    rows = 5
    config = StreamConfig(arena_bytes=64 << 20, io_threads=1, direct_io=False)
    with ExpertPack.open(path) as pack, ExpertStream(path, config) as stream:
        assert pack.header.version == 4
        assert pack.geometry == g
        with Window(stream, backend="cpu") as window, window.turn():
            for layer in range(L):
                x = rng.standard_normal((rows, H)).astype(np.float32)
                ids = np.stack([rng.choice(E, K, replace=False) for _ in range(rows)])
                w = rng.random((rows, K)).astype(np.float32)
                got = window.moe_routed(layer, x, ids.astype(np.int32), w)
                want = _oracle(pack, layer, x, ids, w)
                scale = float(np.abs(want).max())
                np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * scale)


def test_gateless_record_holds_up_and_down_only(tmp_path: Path) -> None:
    g = _geometry("relu2", 0, 0, False)
    path = _pack(tmp_path, g)
    with ExpertPack.open(path) as pack:
        names = [t.name for t in pack.header.tensors]
        assert names == ["up.weight", "down.weight"]
        gate, up, down = pack.expert_weights(1, 3)
        assert gate.shape == (0, H) and up.shape == (INTER, H) and down.shape == (H, INTER)
        assert pack.metadata["geometry"]["gated"] is False
        # The record is up then down, nothing else: half again smaller than a gated one.
        assert pack.header.record_bytes == 2 * INTER * H * 4
    raw = path.read_bytes()
    assert struct.unpack_from("<I", raw, 8)[0] == 4
    assert struct.unpack_from("<I", raw, LAYOUT_FLAGS_OFFSET)[0] == 1


def test_mixed_formats_with_a_new_kind(tmp_path: Path) -> None:
    """Version 4 carries version 3's format classes where the formats differ."""
    g = _geometry("swiglu_clamp", 0, 0.75, True)
    q4, f16 = MatrixFormat("q4", 32, "bf16"), MatrixFormat("f16")
    path = _pack(tmp_path, g, "q4", layer_formats=((q4, q4, f16), (f16, f16, f16)))
    with ExpertPack.open(path) as pack:
        assert pack.header.version == 4
        assert pack.header.mixed
        assert pack.formats_of(1) == (f16, f16, f16)


def test_older_kinds_keep_their_version(tmp_path: Path) -> None:
    for activation, alpha, limit in (("swiglu", 0.0, 0.0), ("swiglu_oai", 1.702, 7.0)):
        g = _geometry(activation, alpha, limit, True)
        with ExpertPack.open(_pack(tmp_path, g)) as pack:
            assert pack.header.version == 2
            assert "gated" not in pack.metadata["geometry"]


def _rewrite(path: Path, at: int, value: int) -> None:
    """Puts the u32 `value` at header offset `at` and makes the header's crc match again."""
    raw = bytearray(path.read_bytes())
    struct.pack_into("<I", raw, at, value)
    struct.pack_into("<I", raw, 4092, zlib.crc32(bytes(raw[:4092])))
    path.write_bytes(bytes(raw))


def test_reader_refuses_a_new_kind_under_an_old_version(tmp_path: Path) -> None:
    path = _pack(tmp_path, _geometry("geglu_tanh", 0, 0, True))
    _rewrite(path, 8, 2)
    with pytest.raises(PackError, match="activation geglu_tanh needs format version 4"):
        ExpertPack.open(path)


def test_reader_refuses_an_unknown_kind_by_its_code(tmp_path: Path) -> None:
    path = _pack(tmp_path, _geometry("geglu_tanh", 0, 0, True))
    _rewrite(path, 1024, 9)
    with pytest.raises(PackError, match="activation is 9"):
        ExpertPack.open(path)


def test_reader_refuses_relu2_with_a_gate(tmp_path: Path) -> None:
    path = _pack(tmp_path, _geometry("geglu_tanh", 0, 0, True))
    _rewrite(path, 1024, 5)
    with pytest.raises(PackError, match="relu2 is for gateless experts"):
        ExpertPack.open(path)


def test_geometry_refuses_relu2_with_a_gate_and_gateless_swiglu() -> None:
    with pytest.raises(ConfigError, match="relu2 is for gateless"):
        _geometry("relu2", 0, 0, True)
    with pytest.raises(ConfigError, match="gateless experts"):
        _geometry("swiglu", 0, 0, False)


def test_reader_refuses_a_constant_a_new_kind_does_not_have(tmp_path: Path) -> None:
    """One canonical header per kind: swiglu_clamp has a limit and no alpha."""
    path = _pack(tmp_path, _geometry("swiglu_clamp", 0, 0.75, True))
    _rewrite(path, 1028, struct.unpack("<I", struct.pack("<f", 1.5))[0])
    with pytest.raises(PackError, match="header field act_alpha must be 0 for swiglu_clamp"):
        ExpertPack.open(path)


def test_reader_refuses_a_missing_constant(tmp_path: Path) -> None:
    path = _pack(tmp_path, _geometry("swiglu_clamp", 0, 0.75, True))
    _rewrite(path, 1032, 0)
    with pytest.raises(PackError, match="act_limit must be finite and positive for swiglu_clamp"):
        ExpertPack.open(path)
