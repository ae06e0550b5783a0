"""The strata pack: one file holding every MoE expert of a model (docs/pack-format.md).

Write one with `write_pack` (or `pack_preset` for synthetic models), read it with `ExpertPack`.
"""

from __future__ import annotations

from strata_stream.pack.geometry import Geometry
from strata_stream.pack.presets import PRESETS, pack_preset
from strata_stream.pack.quant import QuantizedMatrix, dequantize, quantize, quantize_mxfp4
from strata_stream.pack.reader import ExpertPack
from strata_stream.pack.writer import write_pack

__all__ = [
    "PRESETS",
    "ExpertPack",
    "Geometry",
    "QuantizedMatrix",
    "dequantize",
    "pack_preset",
    "quantize",
    "quantize_mxfp4",
    "write_pack",
]
