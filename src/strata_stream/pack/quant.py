"""MLX affine quantization in numpy, so packs hold the bytes mlx-lm checkpoints hold (and
mxfp4's decoding, for checkpoints quantized that way).

`quantize` reproduces MLX's CPU kernel (`mlx/backend/cpu/quantized.cpp`, `quantize<T, U>`)
step by step in float32, so its output is byte-identical to ``mx.quantize(w, group_size, bits)``
on the CPU device. Every operation below is written in the kernel's order on purpose: a
mathematically equal rewrite (multiplying by 1/scale, folding the bias) changes the rounding of
tie cases and breaks byte identity. MLX's Metal kernel differs in two corner cases (it rounds
halves away from zero and floors a group's maximum at 0), so a checkpoint quantized on a GPU may
differ from this in rare elements; the pack copies such checkpoints verbatim anyway.

numpy has no bfloat16, so bf16 arrays travel as uint16 bit patterns (`f32_to_bf16_bits`,
`bf16_bits_to_f32`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

U32Array = npt.NDArray[np.uint32]
F32Array = npt.NDArray[np.float32]

QUANT_BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
MXFP4_GROUP = 32
# The value of each E2M1 (FP4) code: sign bit 3, two exponent bits, one mantissa bit.
FP4_VALUES: F32Array = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)
# Scale/bias storage dtypes by pack name; bf16 is stored as its uint16 bit pattern.
SCALE_NUMPY_DTYPES: dict[str, np.dtype[Any]] = {
    "f32": np.dtype(np.float32),
    "f16": np.dtype(np.float16),
    "bf16": np.dtype(np.uint16),
}


def f32_to_bf16_bits(x: npt.ArrayLike) -> npt.NDArray[np.uint16]:
    """Round float32 values to bfloat16 (nearest, ties to even) and return the bit patterns."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    # Adding 0x7FFF plus the lowest kept bit and truncating is round-half-to-even on the upper
    # 16 bits; overflow of the largest finite values into infinity is the correct result.
    rounded: npt.NDArray[np.uint16] = (
        (bits + (np.uint32(0x7FFF) + ((bits >> 16) & 1))) >> 16
    ).astype(np.uint16)
    # NaNs must stay NaN (the rounding above can carry a NaN's payload into infinity), so keep
    # the sign and exponent and force the quiet bit.
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    if nan.any():
        rounded[nan] = ((bits[nan] >> 16) | 0x0040).astype(np.uint16)
    return rounded


def bf16_bits_to_f32(bits: npt.ArrayLike) -> F32Array:
    """Widen bfloat16 bit patterns (uint16) to float32; exact."""
    b = np.ascontiguousarray(bits, dtype=np.uint16)
    return (b.astype(np.uint32) << 16).view(np.float32)


def to_scale_dtype(x: npt.NDArray[Any], scale_dtype: str) -> npt.NDArray[Any]:
    """Store float values as `scale_dtype` ("f32", "f16", or "bf16" as uint16 bits)."""
    if scale_dtype == "bf16":
        return f32_to_bf16_bits(x)
    return np.asarray(x).astype(SCALE_NUMPY_DTYPES[scale_dtype])


def scale_values_f32(x: npt.NDArray[Any]) -> F32Array:
    """Float32 values of scales or biases stored as float32, float16 or bf16 bits (uint16)."""
    if x.dtype == np.uint16:
        return bf16_bits_to_f32(x)
    return np.asarray(x, dtype=np.float32)


def scale_dtype_name(dtype: np.dtype[Any]) -> str:
    """Pack name of a scale array's numpy dtype; uint16 means bf16 bit patterns."""
    for name, dt in SCALE_NUMPY_DTYPES.items():
        if dt == dtype:
            return name
    raise TypeError(
        f"scales/biases must be float32, float16 or uint16 (bf16 bit patterns), got {dtype}"
    )


@dataclass(frozen=True)
class QuantizedMatrix:
    """One MLX-quantized matrix, exactly as ``mx.quantize`` returns it.

    weight: uint32 ``[rows, cols * bits / 32]``, element j of a row in word ``j * bits // 32``
    at bit ``(j * bits) % 32``.

    mode "affine": scales, biases ``[rows, cols / group_size]`` as float32, float16, or uint16
    holding bfloat16 bit patterns; ``w[r, j] = scales[r, j // g] * q[r, j] + biases[r, j // g]``.

    mode "mxfp4" (OCP microscaling, gpt-oss): 4 bits, groups of 32, q an E2M1 code, scales uint8
    E8M0 exponents, biases None; ``w[r, j] = FP4[q[r, j]] * 2 ** (scales[r, j // 32] - 127)``.
    """

    weight: U32Array
    scales: npt.NDArray[Any]
    biases: npt.NDArray[Any] | None
    bits: int
    group_size: int
    mode: str = "affine"

    def __post_init__(self) -> None:
        if self.mode == "mxfp4":
            self._check_mxfp4()
            return
        if self.mode != "affine":
            raise ValueError(f"QuantizedMatrix.mode must be affine or mxfp4, got {self.mode!r}")
        if self.biases is None:
            raise TypeError("an affine QuantizedMatrix needs biases")
        if self.bits not in QUANT_BITS:
            raise ValueError(f"QuantizedMatrix.bits must be 4 or 8, got {self.bits}")
        if self.group_size not in GROUP_SIZES:
            raise ValueError(
                f"QuantizedMatrix.group_size must be 32, 64 or 128, got {self.group_size}"
            )
        if self.weight.dtype != np.uint32 or self.weight.ndim != 2:
            raise TypeError(
                f"QuantizedMatrix.weight must be a 2-D uint32 array, got "
                f"{self.weight.dtype} {self.weight.shape}"
            )
        if self.scales.dtype != self.biases.dtype:
            raise TypeError(
                f"QuantizedMatrix scales ({self.scales.dtype}) and biases ({self.biases.dtype}) "
                "must share a dtype"
            )
        scale_dtype_name(self.scales.dtype)
        rows, words = self.weight.shape
        groups = words * 32 // self.bits // self.group_size
        for name, arr in (("scales", self.scales), ("biases", self.biases)):
            if arr.shape != (rows, groups):
                raise ValueError(
                    f"QuantizedMatrix.{name} shape {arr.shape} does not fit weight "
                    f"{self.weight.shape} at {self.bits} bits, group {self.group_size} "
                    f"(expected {(rows, groups)})"
                )

    def _check_mxfp4(self) -> None:
        if self.bits != 4 or self.group_size != MXFP4_GROUP:
            raise ValueError(
                f"mxfp4 is 4 bits in groups of {MXFP4_GROUP}, got {self.bits} bits, "
                f"group {self.group_size}"
            )
        if self.weight.dtype != np.uint32 or self.weight.ndim != 2:
            raise TypeError(
                f"QuantizedMatrix.weight must be a 2-D uint32 array, got "
                f"{self.weight.dtype} {self.weight.shape}"
            )
        if self.biases is not None:
            raise TypeError("an mxfp4 QuantizedMatrix has no biases (pass biases=None)")
        rows, words = self.weight.shape
        want = (rows, words * 8 // MXFP4_GROUP)
        if self.scales.dtype != np.uint8 or self.scales.shape != want:
            raise ValueError(
                f"mxfp4 scales must be uint8 {want} for weight {self.weight.shape}, got "
                f"{self.scales.dtype} {self.scales.shape}"
            )

    @property
    def shape(self) -> tuple[int, int]:
        """Logical (rows, cols) of the matrix."""
        rows, words = self.weight.shape
        return rows, words * 32 // self.bits

    @property
    def scale_dtype(self) -> str:
        """The pack's name for the scales' dtype: "e8m0" for mxfp4."""
        return "e8m0" if self.mode == "mxfp4" else scale_dtype_name(self.scales.dtype)


def quantize(
    w: npt.ArrayLike, group_size: int = 64, bits: int = 4, scale_dtype: str | None = None
) -> QuantizedMatrix:
    """Quantize a 2-D float matrix like ``mx.quantize(w, group_size, bits)`` on the CPU.

    Computation is float32 as in MLX. `scale_dtype` (default: "f16" for float16 input, else
    "f32", i.e. MLX's choice of the input dtype) is only the storage dtype of scales and biases.
    """
    a = np.asarray(w)
    if a.dtype.kind != "f":
        raise TypeError(f"quantize needs a float array, got {a.dtype}")
    if a.ndim != 2:
        raise ValueError(f"quantize needs a 2-D matrix, got shape {a.shape}")
    if bits not in QUANT_BITS:
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be 32, 64 or 128, got {group_size}")
    rows, cols = a.shape
    if cols % group_size:
        raise ValueError(f"{cols} columns are not a multiple of group_size {group_size}")
    if scale_dtype is None:
        scale_dtype = "f16" if a.dtype == np.float16 else "f32"
    if scale_dtype not in SCALE_NUMPY_DTYPES:
        raise ValueError(f"scale_dtype must be f32, f16 or bf16, got {scale_dtype!r}")
    x = a.astype(np.float32, copy=False)
    if not np.isfinite(x).all():
        raise ValueError("quantize input contains NaN or infinity")

    g = x.reshape(rows, cols // group_size, group_size)
    n_bins = np.float32((1 << bits) - 1)
    eps = np.float32(1e-7)
    w_max = g.max(axis=-1)
    w_min = g.min(axis=-1)
    # The edge with the larger magnitude becomes the bias and an exact multiple of the scale,
    # which makes 0.0 exactly representable; the scale is negative when that edge is the max.
    mask = np.abs(w_min) > np.abs(w_max)
    scale = np.maximum((w_max - w_min) / n_bins, eps)
    scale = np.where(mask, scale, -scale)
    edge = np.where(mask, w_min, w_max)
    q0 = np.rint(edge / scale)
    nonzero = q0 != 0
    scale = np.where(nonzero, edge / np.where(nonzero, q0, np.float32(1)), scale)
    bias = np.where(nonzero, edge, np.float32(0))

    q = np.rint((g - bias[..., None]) / scale[..., None])
    q = np.clip(q, np.float32(0), n_bins).astype(np.uint32)
    return QuantizedMatrix(
        weight=pack_bits(q.reshape(rows, cols), bits),
        scales=to_scale_dtype(scale.astype(np.float32), scale_dtype),
        biases=to_scale_dtype(bias.astype(np.float32), scale_dtype),
        bits=bits,
        group_size=group_size,
    )


def quantize_mxfp4(w: npt.ArrayLike) -> QuantizedMatrix:
    """Quantize a 2-D float matrix to mxfp4: per group of 32 the smallest power-of-two scale
    that brings the largest magnitude within FP4's 6, then each value to its nearest FP4 code.

    For tests and synthetic packs: a correct mxfp4 matrix, not byte-identical to
    ``mx.quantize(mode="mxfp4")`` (converted checkpoints are copied, never requantized).
    """
    a = np.asarray(w, dtype=np.float32)
    if a.ndim != 2 or a.shape[1] % MXFP4_GROUP:
        raise ValueError(f"quantize_mxfp4 needs [rows, 32 k] values, got shape {a.shape}")
    if not np.isfinite(a).all():
        raise ValueError("quantize_mxfp4 input contains NaN or infinity")
    rows, cols = a.shape
    g = a.reshape(rows, cols // MXFP4_GROUP, MXFP4_GROUP)
    amax = np.abs(g).max(axis=-1)
    exp = np.ceil(np.log2(np.maximum(amax, np.float32(1e-30)) / np.float32(6.0)))
    e = np.clip(exp + 127, 1, 254).astype(np.uint8)
    v = g / e8m0_values(e)[..., None]
    mags = FP4_VALUES[:8]
    nearest = np.abs(np.abs(v)[..., None] - mags).argmin(axis=-1).astype(np.uint32)
    codes = nearest | np.where(np.signbit(v), np.uint32(8), np.uint32(0))
    return QuantizedMatrix(pack_bits(codes.reshape(rows, cols), 4), e, None, 4, 32, mode="mxfp4")


def pack_bits(q: U32Array, bits: int) -> U32Array:
    """Pack [rows, cols] values of `bits` bits into uint32 words, lowest bits first."""
    rows, cols = q.shape
    per_word = 32 // bits
    shifts = (np.arange(per_word, dtype=np.uint32) * np.uint32(bits)).astype(np.uint32)
    words = q.reshape(rows, cols // per_word, per_word) << shifts
    packed: U32Array = np.bitwise_or.reduce(words, axis=-1).astype(np.uint32, copy=False)
    return packed


def unpack_bits(weight: U32Array, bits: int) -> U32Array:
    """Inverse of `pack_bits`: [rows, words] -> [rows, words * 32 / bits] values."""
    rows, words = weight.shape
    per_word = 32 // bits
    shifts = (np.arange(per_word, dtype=np.uint32) * np.uint32(bits)).astype(np.uint32)
    mask = np.uint32((1 << bits) - 1)
    q: U32Array = (weight[:, :, None] >> shifts) & mask
    return q.reshape(rows, words * per_word)


def e8m0_values(e: npt.ArrayLike) -> F32Array:
    """2 ** (e - 127) for uint8 E8M0 exponents, as MLX decodes them (through bfloat16's exponent
    bits: 0 gives 2**-127, 255 gives infinity)."""
    b = np.asarray(e, dtype=np.uint8).astype(np.uint16) << np.uint16(7)
    return bf16_bits_to_f32(np.where(b == 0, np.uint16(0x40), b))


def dequantize(qm: QuantizedMatrix) -> F32Array:
    """Float32 values of a quantized matrix: ``scales * q + biases`` per group (affine), or
    ``FP4[q] * 2 ** (e - 127)`` (mxfp4; exact in float32)."""
    rows, cols = qm.shape
    if qm.mode == "mxfp4":
        codes = unpack_bits(qm.weight, 4).reshape(rows, cols // qm.group_size, qm.group_size)
        with np.errstate(over="ignore", invalid="ignore"):  # 6 * 2**127 is inf, as in MLX
            fp4: F32Array = FP4_VALUES[codes] * e8m0_values(qm.scales)[..., None]
        return fp4.reshape(rows, cols)
    assert qm.biases is not None
    q = unpack_bits(qm.weight, qm.bits).astype(np.float32)
    q = q.reshape(rows, cols // qm.group_size, qm.group_size)
    s = scale_values_f32(qm.scales)[..., None]
    b = scale_values_f32(qm.biases)[..., None]
    out: F32Array = (q * s + b).reshape(rows, cols)
    return out
