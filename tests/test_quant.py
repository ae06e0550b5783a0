"""MLX affine quantization in numpy: error bounds, bit packing, bf16, byte identity with MLX."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from strata_stream.pack.quant import (
    QuantizedMatrix,
    bf16_bits_to_f32,
    dequantize,
    f32_to_bf16_bits,
    pack_bits,
    quantize,
    quantize_mxfp4,
    unpack_bits,
)


@st.composite
def matrices(draw: st.DrawFn) -> tuple[npt.NDArray[np.float32], int, int]:
    group = draw(st.sampled_from([32, 64, 128]))
    bits = draw(st.sampled_from([4, 8]))
    rows = draw(st.integers(1, 3))
    cols = group * draw(st.integers(1, 2))
    # Magnitudes chosen per matrix so tiny, huge and mixed groups all appear.
    mag = draw(st.sampled_from([2.0**-20, 2.0**-7, 1.0, 1024.0]))
    elements = st.floats(-mag, mag, width=32, allow_subnormal=False)
    w = draw(hnp.arrays(np.float32, (rows, cols), elements=elements))
    return w, group, bits


@settings(max_examples=300, deadline=None)
@given(matrices())
def test_dequantize_error_below_one_step(case: tuple[npt.NDArray[np.float32], int, int]) -> None:
    w, group, bits = case
    qm = quantize(w, group, bits, "f32")
    assert qm.shape == w.shape and qm.weight.shape == (w.shape[0], w.shape[1] * bits // 32)
    back = dequantize(qm)
    s = np.repeat(np.abs(qm.scales.astype(np.float64)), group, axis=1)
    b = np.repeat(np.abs(qm.biases.astype(np.float64)), group, axis=1)
    err = np.abs(back.astype(np.float64) - w)
    # Under one step everywhere (only the clipped far edge can exceed half a step), plus float32
    # rounding of s * q + b.
    slop = 4 * 2.0**-24 * (s * ((1 << bits) - 1) + b)
    assert (err <= s + slop).all()
    # The larger-magnitude edge of each group is the bias itself, so it comes back exactly.
    g = w.reshape(w.shape[0], -1, group)
    lo, hi = g.min(-1, keepdims=True), g.max(-1, keepdims=True)
    edge = np.where(np.abs(lo) > np.abs(hi), lo, hi)
    at_edge = (g == edge).reshape(w.shape) & (np.repeat(qm.biases != 0, group, axis=1))
    assert (err[at_edge] == 0).all()


@settings(max_examples=100, deadline=None)
@given(matrices(), st.sampled_from(["f16", "bf16"]))
def test_narrow_scale_dtype_error(
    case: tuple[npt.NDArray[np.float32], int, int], scale_dtype: str
) -> None:
    w, group, bits = case
    if np.abs(w).max() < 1e-3 and scale_dtype == "f16":
        return  # f16 scales underflow for such weights; not a format anyone uses them with
    qm = quantize(w, group, bits, scale_dtype)
    assert qm.scale_dtype == scale_dtype
    ref = quantize(w, group, bits, "f32")
    # Same codes: the narrow dtype is storage only.
    np.testing.assert_array_equal(qm.weight, ref.weight)
    eps = 2.0**-11 if scale_dtype == "f16" else 2.0**-8
    s = np.repeat(np.abs(ref.scales.astype(np.float64)), group, axis=1)
    b = np.repeat(np.abs(ref.biases.astype(np.float64)), group, axis=1)
    err = np.abs(dequantize(qm).astype(np.float64) - w)
    # Subnormal scales and biases lose absolute, not relative, precision.
    tiny = (1 << bits) * (2.0**-24 if scale_dtype == "f16" else 2.0**-133)
    assert (err <= s * (1 + 1e-5) + (s * ((1 << bits) - 1) + b) * eps * 1.01 + tiny).all()


@given(st.sampled_from([4, 8]), st.integers(1, 4), st.integers(1, 4), st.data())
def test_pack_unpack_bits(bits: int, rows: int, words: int, data: st.DataObject) -> None:
    cols = words * 32 // bits
    q = data.draw(
        hnp.arrays(np.uint32, (rows, cols), elements=st.integers(0, (1 << bits) - 1))
    ).astype(np.uint32)
    packed = pack_bits(q, bits)
    assert packed.shape == (rows, words)
    np.testing.assert_array_equal(unpack_bits(packed, bits), q)
    # Element j sits in word j * bits // 32 at bit (j * bits) % 32 (docs/pack-format.md).
    j = cols - 1
    assert (int(packed[0, j * bits // 32]) >> ((j * bits) % 32)) & ((1 << bits) - 1) == q[0, j]


@given(hnp.arrays(np.uint16, 64))
def test_bf16_bits_round_trip(bits: npt.NDArray[np.uint16]) -> None:
    f = bf16_bits_to_f32(bits)
    back = f32_to_bf16_bits(f)
    nan = np.isnan(f)
    np.testing.assert_array_equal(back[~nan], bits[~nan])
    assert np.isnan(bf16_bits_to_f32(back[nan])).all()


@given(hnp.arrays(np.float32, 64, elements=st.floats(-(2.0**127), 2.0**127, width=32)))
def test_bf16_rounding_is_nearest(x: npt.NDArray[np.float32]) -> None:
    y = bf16_bits_to_f32(f32_to_bf16_bits(x)).astype(np.float64)
    finite = np.isfinite(y)
    err = np.abs(y[finite] - x[finite])
    assert (err <= np.abs(x[finite]) * 2.0**-8 + 2.0**-134).all()


def test_bf16_ties_to_even_and_specials() -> None:
    x = np.array(
        [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), np.inf, -np.inf, np.nan, 3.4e38, 0.0, -0.0],
        dtype=np.float32,
    )
    y = bf16_bits_to_f32(f32_to_bf16_bits(x))
    assert y[0] == 1.0 and y[1] == 1 + 2**-6 and y[2] == -1.0
    assert y[3] == np.inf and y[4] == -np.inf and np.isnan(y[5]) and y[6] == np.inf
    assert f32_to_bf16_bits(x)[8] == 0x8000


def test_quantize_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="not a multiple of group_size 64"):
        quantize(np.zeros((2, 96), np.float32), 64)
    with pytest.raises(TypeError, match="float"):
        quantize(np.zeros((2, 64), np.int32))
    with pytest.raises(ValueError, match="NaN"):
        quantize(np.full((1, 32), np.nan, np.float32), 32)
    with pytest.raises(ValueError, match="bits"):
        quantize(np.zeros((1, 32), np.float32), 32, bits=3)
    with pytest.raises(ValueError, match=r"scales shape \(2, 1\) does not fit"):
        QuantizedMatrix(
            np.zeros((2, 8), np.uint32),
            np.zeros((2, 1), np.float32),
            np.zeros((2, 1), np.float32),
            bits=4,
            group_size=32,
        )


# -- byte identity with MLX ---------------------------------------------------------------------


def _cases() -> list[tuple[str, npt.NDArray[np.float32]]]:
    rng = np.random.default_rng(7)
    normal = rng.standard_normal((16, 256)).astype(np.float32)
    groups = normal.copy()
    groups[0] = np.abs(groups[0])  # all positive
    groups[1] = -np.abs(groups[1])  # all negative
    groups[2] = 0.0  # all zero: q0 == 0 path
    groups[3] = 0.5  # constant
    groups[4] = np.round(groups[4] * 2) / 2  # many exact ties
    groups[5] *= 1e-9  # below eps: scale floored at 1e-7
    return [
        ("normal", normal * 0.02),
        ("wide", normal * 1e3),
        ("special groups", groups),
        ("uniform", rng.uniform(-1, 1, (8, 384)).astype(np.float32)),
    ]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_byte_identical_to_mx_quantize(bits: int, group_size: int, dtype: str) -> None:
    mx: Any = pytest.importorskip("mlx.core")
    for name, w in _cases():
        a = mx.array(w).astype(getattr(mx, dtype))
        if dtype == "bfloat16":
            # numpy has no bf16: hand over the exact bf16 values widened to f32.
            w_in = bf16_bits_to_f32(f32_to_bf16_bits(w))
            scale_dtype = "bf16"
        else:
            w_in = w.astype(dtype)
            scale_dtype = "f16" if dtype == "float16" else "f32"
        ours = quantize(w_in, group_size, bits, scale_dtype)
        mw, ms, mb = mx.quantize(a, group_size=group_size, bits=bits)
        view = mx.uint16 if dtype == "bfloat16" else None
        assert np.array(mw).tobytes() == ours.weight.tobytes(), name
        for theirs, mine in ((ms, ours.scales), (mb, ours.biases)):
            theirs_np = np.array(theirs.view(view) if view is not None else theirs)
            assert theirs_np.tobytes() == mine.tobytes(), name
        if dtype == "float32":
            back = np.array(mx.dequantize(mw, ms, mb, group_size=group_size, bits=bits))
            np.testing.assert_array_equal(dequantize(ours), back)


# -- mxfp4 ----------------------------------------------------------------------------------------


def test_mxfp4_dequantize_is_mlx_dequantize() -> None:
    # Every code and every exponent (0 and 255 included), decoded as MLX decodes them.
    mx: Any = pytest.importorskip("mlx.core")
    rng = np.random.default_rng(5)
    words = rng.integers(0, 2**32, (256, 16), dtype=np.uint32)
    words[0] = 0x76543210  # codes 0..7 in order
    words[1] = 0xFEDCBA98  # and 8..15 (the negatives, -0 first)
    scales = np.tile(np.arange(256, dtype=np.uint8)[:, None], (1, 4))
    qm = QuantizedMatrix(words, scales, None, 4, 32, mode="mxfp4")
    theirs = mx.dequantize(mx.array(words), mx.array(scales), group_size=32, bits=4, mode="mxfp4")
    np.testing.assert_array_equal(dequantize(qm), np.array(theirs.astype(mx.float32)))


@settings(max_examples=30, deadline=None)
@given(hnp.arrays(np.float32, (4, 64), elements=st.floats(-1e4, 1e4, width=32)))
def test_quantize_mxfp4_rounds_to_the_nearest_code(w: npt.NDArray[np.float32]) -> None:
    qm = quantize_mxfp4(w)
    back = dequantize(qm).reshape(4, 2, 32)
    scale = 2.0 ** (qm.scales.astype(np.float64) - 127)
    g = w.reshape(4, 2, 32) / scale[..., None]
    assert np.all(np.abs(g) <= 6.0)  # the scale brings every value within FP4's range
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    nearest = grid[np.abs(np.abs(g)[..., None] - grid).argmin(-1)] * np.sign(g)
    np.testing.assert_array_equal(back, (nearest * scale[..., None]).astype(np.float32))


def test_mxfp4_matrices_are_checked() -> None:
    w = np.zeros((2, 8), np.uint32)
    with pytest.raises(ValueError, match="groups of 32"):
        QuantizedMatrix(w, np.zeros((2, 4), np.uint8), None, 4, 16, mode="mxfp4")
    with pytest.raises(ValueError, match="uint8"):
        QuantizedMatrix(w, np.zeros((2, 2), np.float16), None, 4, 32, mode="mxfp4")
    with pytest.raises(TypeError, match="no biases"):
        QuantizedMatrix(w, np.zeros((2, 2), np.uint8), np.zeros((2, 2), np.uint8), 4, 32, "mxfp4")
    with pytest.raises(ValueError, match="mode"):
        QuantizedMatrix(w, np.zeros((2, 2), np.uint8), None, 4, 32, mode="nvfp4")
