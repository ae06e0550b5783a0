"""Pack writer/reader round trips, layout against docs/pack-format.md, argument validation."""

from __future__ import annotations

import dataclasses
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from strata_stream.errors import ConfigError, PackError
from strata_stream.pack import (
    PRESETS,
    ExpertPack,
    Geometry,
    QuantizedMatrix,
    dequantize,
    pack_preset,
    quantize,
    quantize_mxfp4,
    write_pack,
)
from strata_stream.pack.geometry import ACTIVATIONS
from strata_stream.pack.header import MatrixFormat, PackHeader, record_crc

# hidden and moe_intermediate divisible by every group size, small enough to be instant.
GEOM = Geometry(n_layers=2, n_experts=3, top_k=2, hidden=256, moe_intermediate=128)


def float_experts(geometry: Geometry, seed: int = 0) -> Any:
    def experts(layer: int, expert: int) -> tuple[npt.NDArray[np.float32], ...]:
        rng = np.random.default_rng((seed, layer, expert))
        return tuple(
            rng.standard_normal(shape).astype(np.float32) for shape in geometry.matrix_shapes()
        )

    return experts


def float_routers(geometry: Geometry, seed: int = 0) -> npt.NDArray[np.float32]:
    rng = np.random.default_rng((seed, 99))
    shape = (geometry.n_layers, geometry.n_experts, geometry.hidden)
    return rng.standard_normal(shape).astype(np.float32)


def write(tmp_path: Path, name: str = "p.strpk", **kw: Any) -> Path:
    geometry = kw.pop("geometry", GEOM)
    return write_pack(
        tmp_path / name,
        geometry,
        kw.pop("routers", float_routers(geometry)),
        kw.pop("experts", float_experts(geometry)),
        progress=False,
        **kw,
    )


@pytest.mark.parametrize("fmt", ["f32", "f16", "bf16"])
def test_float_round_trip(tmp_path: Path, fmt: str) -> None:
    path = write(tmp_path, weight_format=fmt)
    ref = float_experts(GEOM)
    with ExpertPack.open(path) as pack:
        assert (pack.weight_format, pack.group_size, pack.scale_dtype) == (fmt, 0, None)
        for layer in range(GEOM.n_layers):
            np.testing.assert_array_equal(pack.router_weights(layer), float_routers(GEOM)[layer])
            for expert in range(GEOM.n_experts):
                got = pack.expert_weights(layer, expert)
                for g, w in zip(got, ref(layer, expert), strict=True):
                    assert g.dtype == np.float32 and g.shape == w.shape
                    if fmt == "f32":
                        np.testing.assert_array_equal(g, w)
                    else:
                        # Round-to-nearest: half an ulp (eps/2 relative), or half of f16's
                        # subnormal step 2^-24 near zero.
                        eps = 2.0**-10 if fmt == "f16" else 2.0**-7
                        tol = np.abs(w) * eps / 2 + (2.0**-25 if fmt == "f16" else 0)
                        assert (np.abs(g - w) <= tol).all()
        assert pack.verify(progress=False) == GEOM.n_records


def _quant_tolerance(qm: QuantizedMatrix) -> npt.NDArray[np.float64]:
    """Per-element bound on |dequantized - input| implied by the stored scales and biases.

    MLX's scheme makes the larger-magnitude edge of a group exact and the other edge may clip
    by less than one step, so the error is under one |scale|; storing scales/biases in a
    narrower dtype adds their rounding times the largest q.
    """
    from strata_stream.pack.quant import scale_values_f32

    s = np.abs(scale_values_f32(qm.scales).astype(np.float64))
    b = np.abs(scale_values_f32(qm.biases).astype(np.float64))
    eps = {"f32": 2.0**-23, "f16": 2.0**-10, "bf16": 2.0**-7}[qm.scale_dtype]
    n_bins = (1 << qm.bits) - 1
    per_group = s * (1 + 1e-5) + (n_bins * s + b) * eps + 1e-6
    return np.repeat(per_group, qm.group_size, axis=1)


@pytest.mark.parametrize("scale_dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("fmt", ["q4", "q8"])
def test_quantized_round_trip(tmp_path: Path, fmt: str, group_size: int, scale_dtype: str) -> None:
    path = write(tmp_path, weight_format=fmt, group_size=group_size, scale_dtype=scale_dtype)
    ref = float_experts(GEOM)
    with ExpertPack.open(path) as pack:
        assert (pack.weight_format, pack.group_size, pack.scale_dtype) == (
            fmt,
            group_size,
            scale_dtype,
        )
        np.testing.assert_array_equal(pack.router_weights(1), float_routers(GEOM)[1])
        for layer, expert in [(0, 0), (1, 2)]:
            got = pack.expert_weights(layer, expert)
            stored = pack.stored_weights(layer, expert)
            for g, w, qm in zip(got, ref(layer, expert), stored, strict=True):
                assert isinstance(qm, QuantizedMatrix)
                assert g.shape == w.shape == qm.shape
                assert (np.abs(g - w) <= _quant_tolerance(qm)).all()
                # The writer's quantization is the quant module's, byte for byte.
                expect = quantize(w, group_size, qm.bits, scale_dtype)
                np.testing.assert_array_equal(qm.weight, expect.weight)
                np.testing.assert_array_equal(qm.scales, expect.scales)
        assert pack.verify(progress=False) == GEOM.n_records


def test_quantized_matrices_are_copied_verbatim(tmp_path: Path) -> None:
    mats = {}

    def experts(layer: int, expert: int) -> tuple[QuantizedMatrix, ...]:
        rng = np.random.default_rng((layer, expert))
        out = []
        for rows, cols in GEOM.matrix_shapes():
            out.append(
                QuantizedMatrix(
                    rng.integers(0, 2**32, (rows, cols // 8), dtype=np.uint32),
                    rng.standard_normal((rows, cols // 64)).astype(np.float16),
                    rng.standard_normal((rows, cols // 64)).astype(np.float16),
                    bits=4,
                    group_size=64,
                )
            )
        mats[layer, expert] = out
        return tuple(out)

    path = write(tmp_path, experts=experts, weight_format="q4", group_size=64, scale_dtype="f16")
    with ExpertPack.open(path) as pack:
        for key, ref in mats.items():
            for got, want in zip(pack.stored_weights(*key), ref, strict=True):
                assert isinstance(got, QuantizedMatrix)
                for a, b in [(got.weight, want.weight), (got.scales, want.scales)]:
                    assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
                assert got.biases.tobytes() == want.biases.tobytes()


def test_quantized_matrix_scale_dtype_converted_and_float_format_dequantized(
    tmp_path: Path,
) -> None:
    w = float_experts(GEOM)(0, 0)
    q = tuple(quantize(m, 64, 4, "f32") for m in w)
    bf = write(
        tmp_path, "bf.strpk", experts=lambda layer, e: q, weight_format="q4", scale_dtype="bf16"
    )
    f32 = write(tmp_path, "f.strpk", experts=lambda layer, e: q, weight_format="f32")
    from strata_stream.pack.quant import dequantize, f32_to_bf16_bits

    with ExpertPack.open(bf) as a, ExpertPack.open(f32) as b:
        for got_q, got_f, src in zip(
            a.stored_weights(1, 1), b.expert_weights(1, 1), q, strict=True
        ):
            assert isinstance(got_q, QuantizedMatrix)
            np.testing.assert_array_equal(got_q.weight, src.weight)
            np.testing.assert_array_equal(got_q.scales, f32_to_bf16_bits(src.scales))
            np.testing.assert_array_equal(got_f, dequantize(src))


def test_routers_as_callable_and_tiny_preset(tmp_path: Path) -> None:
    routers = float_routers(GEOM)
    path = write(tmp_path, routers=lambda layer: routers[layer].astype(np.float64))
    with ExpertPack.open(path) as pack:
        np.testing.assert_array_equal(pack.router_weights(0), routers[0])


def test_layout_matches_spec_offsets(tmp_path: Path) -> None:
    # Decode with the offsets written in docs/pack-format.md, independently of header.py.
    path = write(tmp_path, weight_format="q4", group_size=32, scale_dtype="f16")
    data = path.read_bytes()
    assert data[:8] == b"STRATAPK"

    def u32(off: int) -> int:
        return int(struct.unpack_from("<I", data, off)[0])

    def u64(off: int) -> int:
        return int(struct.unpack_from("<Q", data, off)[0])

    assert [u32(o) for o in range(8, 56, 4)] == [2, 4096, 2, 3, 2, 256, 128, 0, 1, 3, 32, 1]
    record_bytes, stride = u64(56), u64(64)
    meta_off, meta_bytes, router_off, router_bytes = u64(72), u64(80), u64(88), u64(96)
    cks_off, cks_bytes, rec_off, file_bytes = u64(104), u64(112), u64(120), u64(128)
    assert (meta_off, router_bytes, cks_bytes) == (4096, 6 * 256 * 4, 6 * 4)
    assert file_bytes == len(data) == rec_off + 6 * stride
    assert stride % 16384 == 0 and stride - 16384 < record_bytes <= stride
    assert router_off % 16384 == cks_off % 16384 == rec_off % 16384 == 0
    assert u32(136) == 9 and u32(140) == zlib.crc32(data[meta_off : meta_off + meta_bytes])
    assert u32(4092) == zlib.crc32(data[:4092])
    assert u32(4088) == zlib.crc32(data[router_off : router_off + router_bytes])
    table = [struct.unpack_from("<IIQQII", data, 144 + 32 * i) for i in range(9)]
    # gate weight: [128 rows, 256 cols * 4 bits / 32 = 32 words]; scales [128, 256 / 32].
    assert table[0] == (0, 0, 0, 128 * 32 * 4, 128, 32)
    assert table[1] == (0, 1, 16384, 128 * 8 * 2, 128, 8)
    assert table[8][:2] == (2, 2) and table[8][4:] == (256, 4)
    assert all(t[2] % 256 == 0 for t in table)
    assert record_bytes == table[8][2] + table[8][3]
    for i in range(6):
        rec = data[rec_off + i * stride : rec_off + i * stride + record_bytes]
        assert record_crc(rec) == u32(cks_off + 4 * i)
        assert not any(data[rec_off + i * stride + record_bytes : rec_off + (i + 1) * stride])


def test_mxfp4_layout_matches_spec_and_round_trips(tmp_path: Path) -> None:
    # Header fields and tensor table as docs/pack-format.md gives them for mxfp4, decoded
    # independently of header.py; the values are quantize_mxfp4's, read back exactly.
    path = write(tmp_path, weight_format="mxfp4", group_size=32, scale_dtype="e8m0")
    data = path.read_bytes()
    # weight_format 5 (mxfp4), group_size 32, scale_format 3 (e8m0)
    assert [int(struct.unpack_from("<I", data, o)[0]) for o in (44, 48, 52)] == [5, 32, 3]
    table = [struct.unpack_from("<IIQQII", data, 144 + 32 * i) for i in range(6)]
    assert int(struct.unpack_from("<I", data, 136)[0]) == 6  # weight and scales per matrix
    # gate weight: [128 rows, 256 cols / 8 words]; scales: one u8 per 32 columns.
    assert table[0] == (0, 0, 0, 128 * 32 * 4, 128, 32)
    assert table[1] == (0, 1, 16384, 128 * 8, 128, 8)
    assert [t[:2] for t in table] == [(m, r) for m in range(3) for r in (0, 1)]
    ref = float_experts(GEOM)
    with ExpertPack.open(path) as pack:
        assert (pack.weight_format, pack.group_size, pack.scale_dtype) == ("mxfp4", 32, "e8m0")
        for got, w in zip(pack.expert_weights(1, 2), ref(1, 2), strict=True):
            np.testing.assert_array_equal(got, dequantize(quantize_mxfp4(w)))
        assert pack.verify(progress=False) == GEOM.n_records
    for bad in ({"group_size": 64}, {"scale_dtype": "f16"}):
        with pytest.raises(ConfigError, match="mxfp4 has groups of 32 and e8m0 scales"):
            write(tmp_path, "x.strpk", weight_format="mxfp4", **{"group_size": 32,
                  "scale_dtype": "e8m0", **bad})  # fmt: skip
    with pytest.raises(ConfigError, match="e8m0 is mxfp4's"):
        write(tmp_path, "x.strpk", weight_format="q4", scale_dtype="e8m0")


def test_qwen3_layout_is_one_exact_stride() -> None:
    p = PRESETS["qwen3-30b-a3b"]
    h = PackHeader(p.geometry, "q4", 64, "f16", meta_bytes=3000)
    assert h.record_bytes == h.record_stride == 2654208  # 162 SSD pages, no padding
    assert h.file_bytes > 16e9


def test_reader_api(tmp_path: Path) -> None:
    path = write(tmp_path, weight_format="f16")
    pack = ExpertPack.open(path)
    assert pack.geometry == GEOM and pack.path == path
    assert pack.metadata["format"] == "strata-pack"
    assert pack.record_offset(1, 2) == pack.records_offset + 5 * pack.record_stride
    assert len(pack.read_record(0, 1)) == pack.record_bytes
    assert pack.checksum(0, 1) == record_crc(pack.read_record(0, 1))
    seen: list[tuple[int, int]] = []
    pack.verify(progress=False, on_record=lambda layer, e: seen.append((layer, e)))
    assert seen == [(layer, e) for layer in range(2) for e in range(3)]
    with pytest.raises(IndexError, match=r"layer 2 out of range 0\.\.1"):
        pack.expert_weights(2, 0)
    with pytest.raises(IndexError, match=r"expert -1 out of range 0\.\.2"):
        pack.record_offset(0, -1)
    with pytest.raises(IndexError, match="layer 5"):
        pack.router_weights(5)
    pack.close()
    pack.close()
    assert pack.closed
    with pytest.raises(ValueError, match="closed"):
        pack.read_record(0, 0)


def test_write_is_atomic_on_error(tmp_path: Path) -> None:
    def experts(layer: int, expert: int) -> Any:
        if layer == 1:
            raise RuntimeError("boom")
        return float_experts(GEOM)(layer, expert)

    with pytest.raises(RuntimeError, match="boom"):
        write(tmp_path, experts=experts)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n_layers": 0}, "n_layers"),
        ({"n_experts": -1}, "n_experts"),
        ({"top_k": 5}, "top_k"),
        ({"hidden": 2.0}, "hidden"),
        ({"moe_intermediate": True}, "moe_intermediate"),
        ({"routing": "softmax"}, "routing"),
        ({"norm_topk_prob": 1}, "norm_topk_prob"),
        ({"n_layers": 2**32}, "n_layers"),
    ],
)
def test_geometry_validation(kwargs: dict[str, Any], field: str) -> None:
    base: dict[str, Any] = dict(n_layers=2, n_experts=4, top_k=2, hidden=64, moe_intermediate=32)
    with pytest.raises(ConfigError, match=f"Geometry.{field}"):
        Geometry(**{**base, **kwargs})


def test_geometry_accepts_numpy_ints() -> None:
    g = Geometry(np.int64(2), 4, 2, 64, 32, "topk_softmax", np.bool_(False))  # type: ignore[arg-type]
    assert type(g.n_layers) is int and g.norm_topk_prob is False
    assert Geometry.from_dict(g.to_dict()) == g


def test_shape_and_dtype_errors(tmp_path: Path) -> None:
    good = float_experts(GEOM)

    def bad_shape(layer: int, expert: int) -> Any:
        gate, up, down = good(layer, expert)
        return (gate, up, down.T) if (layer, expert) == (1, 2) else (gate, up, down)

    msg = r"layer 1 expert 2 down: expected shape \(256, 128\), got \(128, 256\)"
    with pytest.raises(ValueError, match=msg):
        write(tmp_path, experts=bad_shape)
    with pytest.raises(TypeError, match="layer 0 expert 0 gate: expected a float array"):
        write(tmp_path, experts=lambda layer, e: tuple(m.astype(np.int32) for m in good(layer, e)))
    with pytest.raises(TypeError, match=r"experts\(0, 0\) must return \(gate, up, down\)"):
        write(tmp_path, experts=lambda layer, e: good(layer, e)[:2])
    with pytest.raises(ValueError, match=r"router of layer 0: expected shape \(3, 256\)"):
        write(tmp_path, routers=float_routers(GEOM).transpose(0, 2, 1))
    with pytest.raises(ValueError, match="routers has 1 layers"):
        write(tmp_path, routers=float_routers(GEOM)[:1])
    q8 = tuple(quantize(m, 64, 8) for m in good(0, 0))
    msg = "has 8 bits, group 64; this q4 pack needs 4 bits, group 64"
    with pytest.raises(ValueError, match=msg):
        write(tmp_path, experts=lambda layer, e: q8, weight_format="q4", group_size=64)
    with pytest.raises(ConfigError, match="weight_format"):
        write(tmp_path, weight_format="q3")
    with pytest.raises(ConfigError, match="group_size"):
        write(tmp_path, weight_format="q4", group_size=16)
    odd = Geometry(1, 2, 1, 96, 64)
    with pytest.raises(ConfigError, match="hidden 96 is not a multiple of group_size 64"):
        write(tmp_path, geometry=odd, weight_format="q8", group_size=64)
    assert list(tmp_path.iterdir()) == []


def test_presets_are_deterministic(tmp_path: Path) -> None:
    a = pack_preset("tiny", tmp_path / "a.strpk", progress=False)
    b = pack_preset("tiny", tmp_path / "b.strpk", progress=False)
    c = pack_preset("tiny", tmp_path / "c.strpk", seed=1, progress=False)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()
    with ExpertPack.open(a) as pack:
        assert pack.geometry == PRESETS["tiny"].geometry and pack.weight_format == "f16"


@pytest.mark.parametrize("fmt", ["q4", "q8", "bf16", "mxfp4"])
def test_preset_formats_have_sane_weights(tmp_path: Path, fmt: str) -> None:
    path = pack_preset("tiny", tmp_path / "t.strpk", weight_format=fmt, progress=False)
    with ExpertPack.open(path) as pack:
        assert pack.verify(progress=False) == pack.n_records
        w = np.concatenate([m.ravel() for m in pack.expert_weights(3, 15)])
        assert 0.01 < w.std() < 0.04 and abs(w.mean()) < 0.005
        r = pack.router_weights(0)
        assert abs(r.std() * np.sqrt(pack.geometry.hidden) - 1) < 0.2


def test_pack_preset_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown preset 'nope'; known presets: tiny"):
        pack_preset("nope", tmp_path / "x")
    with pytest.raises(ConfigError, match="seed"):
        pack_preset("tiny", tmp_path / "x", seed=-1)
    with pytest.raises(ConfigError, match="weight_format"):
        pack_preset("tiny", tmp_path / "x", weight_format="int4")


def test_record_crc_is_crc32c_and_agrees_with_the_portable_table() -> None:
    from strata_stream import _core

    assert record_crc(b"123456789") == 0xE3069283  # the CRC-32C check value
    assert _core.crc32c(b"123456789") == 0xE3069283
    assert record_crc(bytes(32)) == 0x8A9136AA  # RFC 3720 B.4
    assert record_crc(b"\xff" * 32) == 0x62A8AB43
    rng = np.random.default_rng(5)
    data = rng.integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    # Continuation from a seed, across the GIL-release threshold and unaligned starts.
    whole = record_crc(data)
    for cut in (0, 1, 4095, 70000, len(data)):
        assert record_crc(data[cut:], record_crc(data[:cut])) == whole
    assert record_crc(memoryview(data)[3:]) == record_crc(data[3:])
    with pytest.raises((BufferError, ValueError), match="contiguous"):
        record_crc(np.arange(10, dtype=np.uint8)[::2])


def _mixed_formats() -> tuple[Any, ...]:
    from strata_stream.pack.header import MatrixFormat

    q4 = MatrixFormat("q4", 64, "bf16")
    q8 = MatrixFormat("q8", 128, "f16")
    bf16 = MatrixFormat("bf16")
    # granitemoe-like (an 8-bit down projection) then muse_spark-like (an unquantized layer).
    return ((q4, q4, q8), (bf16, bf16, bf16))


def test_mixed_formats_round_trip_as_version_3(tmp_path: Path) -> None:
    """Formats that differ by matrix and by layer (mlx-lm's quantization predicates) are a
    version 3 pack: each matrix stored in its own format, read back exactly by the Python
    reader, parsed by the engine's, every record's checksum over the largest class's payload.
    The same formats given uniformly write the version 2 pack, byte for byte."""
    from strata_stream import ExpertStream, _core

    formats = _mixed_formats()
    path = write(tmp_path, layer_formats=formats)
    data = path.read_bytes()
    assert struct.unpack_from("<I", data, 8)[0] == 3
    ref = float_experts(GEOM)
    with ExpertPack.open(path) as pack:
        assert pack.mixed and pack.formats_of(0) == formats[0] and pack.formats_of(1) == formats[1]
        assert (pack.weight_format, pack.group_size, pack.scale_dtype) == ("q4", 64, "bf16")
        for layer, lf in enumerate(formats):
            for e in range(GEOM.n_experts):
                for got, want, f in zip(pack.stored_weights(layer, e), ref(layer, e), lf,
                                        strict=True):  # fmt: skip
                    if f.weight_format == "bf16":
                        from strata_stream.pack.quant import f32_to_bf16_bits

                        np.testing.assert_array_equal(got, f32_to_bf16_bits(want))
                        continue
                    q = quantize(want, f.group_size, int(f.weight_format[1]), f.scale_dtype)
                    assert isinstance(got, QuantizedMatrix)
                    assert (got.bits, got.group_size) == (q.bits, q.group_size)
                    np.testing.assert_array_equal(got.weight, q.weight)
                    np.testing.assert_array_equal(got.scales, q.scales)
        assert pack.verify(progress=False) == GEOM.n_records
        record_bytes = pack.record_bytes
        meta = pack.metadata
    assert meta["version"] == 3 and meta["layer_class"] == [0, 1]
    assert meta["format_classes"][0]["down"] == {
        "weight_format": "q8", "group_size": 128, "scale_dtype": "f16"
    }  # fmt: skip
    assert _core.read_layout(str(path))["record_bytes"] == record_bytes
    with ExpertStream(path) as stream:
        assert stream.n_layers == 2
    one = formats[0][0]
    uniform = write(tmp_path, "u.strpk", layer_formats=((one, one, one),) * 2)
    plain = write(tmp_path, "v.strpk", weight_format="q4", group_size=64, scale_dtype="bf16")
    assert uniform.read_bytes() == plain.read_bytes()


@pytest.mark.parametrize(
    ("offset", "value", "message"),
    [
        (1040, 0, "n_classes is 0"),
        (1632, 0x12, "layer 0 is of format class 2"),
        (1632, 0x00, "format class 1 is never used"),
        (1044, 4, "format class 0's gate differs|format class 0 gate"),
    ],
)
def test_a_crafted_version_3_header_is_refused_by_both_readers(
    tmp_path: Path, offset: int, value: int, message: str
) -> None:
    from strata_stream import _core
    from strata_stream.errors import PackError

    path = write(tmp_path, layer_formats=_mixed_formats())
    data = bytearray(path.read_bytes())
    if offset == 1632:
        data[offset] = value
    else:
        struct.pack_into("<I", data, offset, value)
    struct.pack_into("<I", data, 4092, zlib.crc32(bytes(data[:4092])))
    path.write_bytes(bytes(data))
    with pytest.raises(PackError, match=message):
        ExpertPack.open(path)
    with pytest.raises(PackError, match=message):
        _core.read_layout(str(path))


# ---- the writer's headers through the engine's parser (the one parser) -------------------------

_FLOAT_FORMATS = st.sampled_from(["f32", "f16", "bf16"]).map(lambda f: MatrixFormat(f))
_MATRIX_FORMATS = st.one_of(
    _FLOAT_FORMATS,
    st.just(MatrixFormat("mxfp4", 32, "e8m0")),
    st.builds(
        MatrixFormat,
        st.sampled_from(["q4", "q8"]),
        st.sampled_from([32, 64, 128]),
        st.sampled_from(["f32", "f16", "bf16"]),
    ),
)


@st.composite
def _written_headers(draw: st.DrawFn) -> PackHeader:
    """Any header the writer makes within the engine's limits: every format, uniform (version 2)
    or differing by layer and matrix (version 3), every routing, activation (version 4 beyond
    swiglu and swiglu_oai, gateless with relu2) and bias dtype."""
    n_layers = draw(st.one_of(st.integers(1, 40), st.sampled_from([4095, 4096])))
    n_experts = draw(st.one_of(st.integers(1, 300), st.just(65536)))
    activation = draw(st.sampled_from(ACTIVATIONS))
    positive = st.floats(1e-3, 1e6, allow_nan=False, allow_infinity=False)
    geometry = Geometry(
        n_layers=n_layers,
        n_experts=n_experts,
        top_k=draw(st.integers(1, min(n_experts, 64))),
        # Multiples of 128: every group size divides them.
        hidden=128 * draw(st.integers(1, 64)),
        moe_intermediate=128 * draw(st.integers(1, 64)),
        routing=draw(st.sampled_from(["softmax_topk", "topk_softmax", "external"])),
        norm_topk_prob=draw(st.booleans()),
        activation=activation,
        act_alpha=draw(positive),
        act_limit=draw(positive),
        gated=activation != "relu2",
    )
    layer_formats: tuple[Any, ...] = ()
    if draw(st.booleans()):  # formats by layer and matrix: a version 3 pack unless uniform
        classes = draw(st.lists(st.tuples(*[_MATRIX_FORMATS] * 3), min_size=1, max_size=5))
        order = draw(st.lists(st.integers(0, len(classes) - 1), min_size=1, max_size=8))
        layer_formats = tuple(classes[order[layer % len(order)]] for layer in range(n_layers))
    pack = draw(_MATRIX_FORMATS)
    u32 = st.integers(0, 2**32 - 1)
    return PackHeader(
        geometry,
        pack.weight_format,
        pack.group_size,
        pack.scale_dtype,
        draw(st.integers(0, 2**40)),
        draw(u32),
        draw(u32),
        bias_dtype=draw(st.sampled_from([None, "f32", "f16", "bf16"])),
        layer_formats=layer_formats,
    )


@settings(max_examples=300, deadline=None)
@given(header=_written_headers())
def test_every_header_the_writer_makes_parses_to_what_it_wrote(header: PackHeader) -> None:
    """The engine's parser (`_core.read_layout`, behind the reader's parse_header) reads back
    exactly the header the writer's PackHeader wrote, for every format, version 2 and 3: the
    same header, which writes the same bytes again; the file size is checked against it."""
    from strata_stream import _core
    from strata_stream.pack.header import parse_header

    assume(header.file_bytes < 2**64)  # beyond, the header's u64 fields cannot hold the pack
    data = header.to_bytes()
    parsed = parse_header(data, "pack written", header.file_bytes)
    assert parsed == header
    assert parsed.to_bytes() == data
    fields = _core.read_layout(data, "pack written")
    assert fields["version"] == (4 if header.geometry.extended else 3 if header.mixed else 2)
    assert fields["gated"] == header.geometry.gated
    assert (fields["meta_crc"], fields["router_crc"]) == (header.meta_crc, header.router_crc)
    assert fields["layer_class"] == list(header.layer_class)
    with pytest.raises(PackError, match="^pack written: file is .* but header field file_bytes"):
        _core.read_layout(data, "pack written", header.file_bytes + 1)


def test_each_matrix_format_divides_its_own_input_width_alone(tmp_path: Path) -> None:
    """mlx-lm quantizes a matrix only where the group size divides its input width: at a
    moe_intermediate of 32, gate and up (input hidden) are q4 g64 and down (input 32) stays
    float. Both readers take that pack, and the CPU backend computes it as from the floats'
    own quantization; a q4 g64 down at that width is refused by name."""
    from strata_stream import ExpertStream, Window, _core
    from strata_stream.pack.header import MatrixFormat

    geometry = dataclasses.replace(GEOM, moe_intermediate=32)
    q4, f32 = MatrixFormat("q4", 64, "f16"), MatrixFormat("f32")
    path = write(tmp_path, geometry=geometry, layer_formats=((q4, q4, f32),) * geometry.n_layers)
    assert _core.read_layout(str(path))["record_bytes"] > 0
    # The oracle: the same experts in f32, gate and up as their q4 g64 values.
    from strata_stream.pack.quant import dequantize

    raw = float_experts(geometry)

    def as_stored(layer: int, e: int) -> tuple[npt.NDArray[np.float32], ...]:
        g, u, d = raw(layer, e)
        return (*(dequantize(quantize(m, 64, 4, "f16")) for m in (g, u)), d)

    oracle = write(tmp_path, "f32.strpk", geometry=geometry, experts=as_stored)
    x = np.random.default_rng(1).standard_normal((3, geometry.hidden)).astype(np.float32)
    outs = []
    for p in (path, oracle):
        with ExpertStream(p) as stream, Window(stream) as w, w.turn():
            outs.append([w.moe(layer, x) for layer in range(geometry.n_layers)])
    for got, want in zip(*outs, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    with pytest.raises(ConfigError, match="moe_intermediate 32 is not a multiple of group_size"):
        write(tmp_path, "bad.strpk", geometry=geometry,
              layer_formats=((q4, q4, q4),) * geometry.n_layers)  # fmt: skip
