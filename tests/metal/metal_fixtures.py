"""Fixtures of the Metal-kernel tests: the emulator harness and packs of every weight format.

A plain module, not a conftest.py: tests/ modules import names from tests/conftest.py as
`conftest`, and a second conftest module on the path would shadow it. Test files import the
fixtures they use from here."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from shim_build import build_harness

from strata_stream.pack import Geometry, write_pack
from strata_stream.pack.quant import QuantizedMatrix, to_scale_dtype

# (weight_format, group_size, scale_dtype): every format the pack defines.
FORMATS: list[tuple[str, int, str]] = [("f32", 64, "f16"), ("f16", 64, "f16"), ("bf16", 64, "f16")]
FORMATS += [(q, g, s) for q in ("q4", "q8") for g in (32, 64, 128) for s in ("f32", "f16", "bf16")]
FORMATS += [("mxfp4", 32, "e8m0")]


def format_id(fmt: tuple[str, int, str]) -> str:
    w, g, s = fmt
    return w if not w.startswith("q") else f"{w}_g{g}_s{s}"


@pytest.fixture(scope="session", name="harness")
def harness_fixture() -> Path:
    return build_harness()


def _random_quantized(
    rng: np.random.Generator, rows: int, cols: int, bits: int, group: int, scale_dtype: str
) -> QuantizedMatrix:
    # Random codes with signed scales and biases: negative scales are legal in MLX checkpoints
    # and must dequantize the same way as positive ones.
    words = rng.integers(0, 2**32, size=(rows, cols * bits // 32), dtype=np.uint64)
    scales = rng.standard_normal((rows, cols // group)).astype(np.float32) * (
        0.3 / (2**bits) / np.sqrt(cols)
    )
    biases = rng.standard_normal((rows, cols // group)).astype(np.float32) * (0.1 / np.sqrt(cols))
    return QuantizedMatrix(
        weight=words.astype(np.uint32),
        scales=to_scale_dtype(scales, scale_dtype),
        biases=to_scale_dtype(biases, scale_dtype),
        bits=bits,
        group_size=group,
    )


PackMaker = Callable[..., Path]


@pytest.fixture(scope="session", name="format_pack")
def format_pack_fixture(tmp_path_factory: pytest.TempPathFactory) -> PackMaker:
    """format_pack((fmt, group, scale_dtype), routing) -> a small pack in that format."""
    cache: dict[tuple[Any, ...], Path] = {}

    def make(
        fmt: tuple[str, int, str], routing: str = "softmax_topk", gpt_oss: bool = False
    ) -> Path:
        """gpt_oss: the clamped SwiGLU and bf16 expert Linear biases."""
        key = (fmt, routing, gpt_oss)
        if key in cache:
            return cache[key]
        weight_format, group, scale_dtype = fmt
        quant = weight_format not in ("f32", "f16", "bf16")
        # Float formats: widths that are not multiples of a lane's 16 columns (tail path).
        hidden, inter = (256, 128) if quant else (72, 40)
        top_k = 3 if routing == "topk_softmax" else 2
        act = "swiglu_oai" if gpt_oss else "swiglu"
        g = Geometry(3, 8, top_k, hidden, inter, routing, True, activation=act)
        bits = 4 if weight_format == "q4" else 8

        def experts(layer: int, expert: int) -> tuple[Any, ...]:
            mats = matrices(layer, expert)
            if not gpt_oss:
                return mats
            rng = np.random.default_rng((8, layer, expert))
            return (
                *mats,
                *(rng.standard_normal(n).astype(np.float32) for n in (inter, inter, hidden)),
            )

        def matrices(layer: int, expert: int) -> tuple[Any, ...]:
            rng = np.random.default_rng((7, layer, expert))
            shapes = ((inter, hidden), (inter, hidden), (hidden, inter))
            if weight_format == "mxfp4":  # float values the writer quantizes (quantize_mxfp4)
                return tuple((rng.standard_normal(s) / np.sqrt(s[1])).astype(np.float32)
                             for s in shapes)  # fmt: skip
            if quant:
                return tuple(
                    _random_quantized(rng, r, c, bits, group, scale_dtype) for r, c in shapes
                )
            return tuple(
                (rng.standard_normal(s) / np.sqrt(s[1])).astype(np.float32) for s in shapes
            )

        rng = np.random.default_rng(11)
        routers = [rng.standard_normal((8, hidden)).astype(np.float32) for _ in range(3)]
        name = f"{format_id(fmt)}-{routing}{'-oai' if gpt_oss else ''}"
        path = tmp_path_factory.mktemp("metal-packs") / f"{name}.strpk"
        write_pack(
            path,
            g,
            routers,
            experts,
            weight_format=weight_format,
            group_size=group,
            scale_dtype=scale_dtype,
            bias_dtype="bf16" if gpt_oss else None,
            progress=False,
        )
        cache[key] = path
        return path

    return make
