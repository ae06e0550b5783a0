"""The streaming engine under an mlx-lm model: one ExpertStream and Window for all MoE blocks.

Every MoE block of the model calls `MoeEngine.run(layer, ...)` in decoder order during a forward
pass; the Window's turn is the pass (it opens at pack layer 0 and closes after the last).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np
import numpy.typing as npt

from strata_stream.config import StreamConfig
from strata_stream.errors import ConfigError
from strata_stream.pack.header import PackHeader
from strata_stream.pack.reader import ExpertPack
from strata_stream.stream import ABSENT, ExpertStream
from strata_stream.window import Window

if TYPE_CHECKING:
    from strata_stream.mlx_lm.prediction import Predictor

# "cpu": the Window's CPU backend computes the experts; "metal": the same routed calls on a
# Window with the Metal backend (macOS builds; elsewhere a ConfigError at load); "mlx": MLX's own
# gather_qmm over views of the arena.
EXPERT_MODES = ("cpu", "mlx", "metal")
# How the CPU backend rounds (experts="cpu"): "mlx" reproduces mlx-lm's own CPU arithmetic
# bitwise (q4/q8 packs with activations in the scales' dtype; mxfp4 packs with bfloat16 or
# float32 activations and biases of the same dtype); "float32" rounds each output once
# (faster, and closer to the exact value, but not mlx-lm's numbers); "auto" takes "mlx"
# wherever the pack and the activations allow it.
ARITHMETICS = ("auto", "mlx", "float32")
_MLX_ARITHMETIC_DTYPES = {"bfloat16": mx.bfloat16, "float32": mx.float32}
_MX_DTYPES = {
    "f32": mx.float32, "f16": mx.float16, "bf16": mx.bfloat16, "u32": mx.uint32, "e8m0": mx.uint8,
}  # fmt: skip
_ROLE_KEYS = {0: "weight", 1: "scales", 2: "biases", 3: "bias"}


@dataclass
class BlockRef:
    """One MoE block of the model and its place in the pack."""

    layer: int  # pack layer
    decoder_layer: int
    block: Any  # the module that calls the switch (the model's own block: gate, shared experts)
    switch: Any  # the block's own SwitchGLU, its expert tensors stripped
    # "cpu": the Window's backend computes the experts; "mlx": the switch's own modules over
    # the arena (blocks.py decides, per block, from what the backend computes).
    kernels: str = "cpu"
    predictor: Predictor | None = None  # set once the stand-in exists


class ArenaTensors:
    """The arena as MLX arrays ``[n_slots, rows, cols]`` per record tensor, for gather_qmm.

    Slot s of tensor t is the bytes at ``s * slot_stride + t.offset``: each tensor is a strided
    view of one flat uint8 array over the whole arena, so slot ids are the gather indices
    (rhs_indices) directly and the views need no per-call index translation.

    macOS (unverified here: this machine has no Metal): MLX can adopt page-aligned host memory
    without a copy (``mx.asarray(buffer, copy=False)``), so the flat array IS the arena and
    `base()` costs nothing. Linux MLX cannot adopt memory (it raises), so `base()` copies the
    arena into a fresh MLX array each wave; the views, strides and indices are the same code
    either way, which the Linux tests prove bitwise against plain mlx-lm.
    """

    def __init__(self, stream: ExpertStream, header: PackHeader) -> None:
        self.stream = stream
        self.header = header  # each layer's tensor table (its format class's)
        self._adopted: mx.array | None = None
        if sys.platform == "darwin" and mx.metal.is_available():  # pragma: no cover - macOS
            try:
                self._adopted = mx.asarray(stream.arena_view().reshape(-1), copy=False)
            except (TypeError, ValueError, RuntimeError):
                self._adopted = None
        self.zero_copy = self._adopted is not None

    def base(self) -> mx.array:
        if self._adopted is not None:  # pragma: no cover - macOS
            return self._adopted
        return mx.array(self.stream.arena_view().reshape(-1))

    def views(self, base: mx.array, layer: int) -> dict[tuple[int, str], mx.array]:
        """(matrix, role key) -> [n_slots, ...] view of every slot's tensor, as `layer`'s
        records hold it."""
        n_slots, stride = self.stream.n_slots, self.stream.arena_view().shape[1]
        out: dict[tuple[int, str], mx.array] = {}
        for t in self.header.tensors_of(layer):
            dtype = _MX_DTYPES[t.dtype]
            size = dtype.size
            typed = mx.view(base, dtype)
            if t.role == 3:  # a Linear bias, [1, rows] in the record, [n_slots, rows] here
                shape: tuple[int, ...] = (n_slots, t.cols)
                strides: tuple[int, ...] = (stride // size, 1)
            else:
                shape = (n_slots, t.rows, t.cols)
                strides = (stride // size, t.cols, 1)
            out[(t.matrix, _ROLE_KEYS[t.role])] = mx.as_strided(
                typed, shape, strides, t.offset // size
            )
        return out


class MoeEngine:
    """Owns the stream and the Window; runs one MoE block call through the handshake."""

    def __init__(
        self,
        pack: ExpertPack,
        config: StreamConfig,
        experts: str,
        blocks: list[BlockRef],
        arithmetic: str = "auto",
    ) -> None:
        if experts not in EXPERT_MODES:
            raise ConfigError(f"experts must be one of {', '.join(EXPERT_MODES)}, got {experts!r}")
        if arithmetic not in ARITHMETICS:
            raise ConfigError(
                f"arithmetic must be one of {', '.join(ARITHMETICS)}, got {arithmetic!r}"
            )
        self.arithmetic = arithmetic
        self.experts = experts
        self.config = config
        self.blocks = blocks
        self.top_k = pack.geometry.top_k
        self.hidden = pack.geometry.hidden
        self.stream = ExpertStream(pack.path, config)
        # A route override (trace/routing.py: a load test routing by a real trace) replaces the
        # ids a block chose, and the predictions, with its own.
        self.route_override: Callable[[int, mx.array, mx.array], mx.array] | None = None
        try:
            self.window = Window(self.stream, backend="metal" if experts == "metal" else "cpu")
            if experts != "mlx" and (why := self.window.per_entry_unsupported):
                raise ConfigError(f"experts={experts!r}: {why}")
            # Per pack layer, the activation dtypes whose MLX arithmetic the Window's backend
            # reproduces for its experts' formats (the engine decides: a q4/q8 layer's scales'
            # dtype; mxfp4, any whose Linear biases, if any, share it).
            self.mlx_dtypes: list[tuple[mx.Dtype, ...]] = [
                tuple(
                    d
                    for name, d in _MLX_ARITHMETIC_DTYPES.items()
                    if not self.window.arithmetic_unsupported(name, b.layer)
                )
                for b in blocks
            ]
            for b in blocks:
                # A pack whose formats differ by layer: a layer MLX computes with other kernels
                # (unquantized: gather_mm) runs them itself, so the model stays bitwise.
                if (b.kernels == "cpu" and pack.mixed and arithmetic != "float32"
                        and not self.mlx_dtypes[b.layer]):  # fmt: skip
                    b.kernels = "mlx"
            cpu_layers = [b.layer for b in blocks if b.kernels == "cpu"]
            if arithmetic == "mlx" and (
                experts == "mlx" or any(not self.mlx_dtypes[i] for i in cpu_layers)
            ):
                raise ConfigError(
                    "arithmetic='mlx' needs experts='cpu' and q4/q8 experts with bfloat16 or "
                    "float32 scales, or mxfp4 experts with bfloat16 or float32 biases (this is "
                    f"experts={experts!r}, {pack.weight_format} with {pack.scale_dtype} scales)"
                )
            mlx_kernels = any(b.kernels == "mlx" for b in blocks)
            self.arena = ArenaTensors(self.stream, pack.header) if mlx_kernels else None
        except BaseException:
            if hasattr(self, "window"):
                self.window.close()
            self.stream.close()
            raise
        self.closed = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.window.close()
            self.stream.close()

    # ---- turns -----------------------------------------------------------------------------
    def _begin(self, layer: int) -> None:
        # A forward pass that failed part-way (an exception in attention, say) leaves the turn
        # open at some later layer; the next pass starts at layer 0 again, so close it.
        if layer == 0:
            self.window.restart_pass()

    # ---- prediction ------------------------------------------------------------------------
    def predictions(self, layer: int, x: mx.array, rows: int) -> list[mx.array | None]:
        """Layers l+1 and l+2's choice for this layer's input, where the engine will use them
        (it decides: `Window.wants_predictions`): [rows, k] ids, unevaluated, or None (the
        engine then falls back to the layer's profile). The blocks' own routing, reached by
        structure (prediction.py)."""
        out: list[mx.array | None] = [None, None]
        want = self.window.wants_predictions(layer, rows)
        for d in (1, 2):
            nxt = layer + d
            if not want[d - 1] or nxt >= len(self.blocks):
                continue
            predictor = self.blocks[nxt].predictor
            ids = predictor(x) if predictor is not None else None
            if ids is not None and ids.shape[0] != rows:
                ids = None  # a block that reshapes its input otherwise: no prediction
            if self.route_override is not None and ids is not None:
                ids = self.route_override(nxt, x, ids)
            out[d - 1] = ids
        return out

    def prediction_methods(self) -> list[str]:
        """Per pack layer, how its experts are predicted (prediction.METHODS; "unused" before
        the first prediction of it)."""
        return [
            (b.predictor.method if b.predictor is not None else None) or "unused"
            for b in self.blocks
        ]

    # ---- the two expert paths --------------------------------------------------------------
    def _routed_ids(self, layer: int, x: mx.array, indices: mx.array) -> mx.array:
        if indices.shape[-1] != self.top_k:
            raise ConfigError(
                f"MoE block {layer} routes {indices.shape[-1]} experts per token, the pack "
                f"{self.top_k} (a pack of another configuration?)"
            )
        if self.route_override is not None:
            indices = self.route_override(layer, x, indices)
        return indices

    def run_cpu(self, layer: int, x: mx.array, indices: mx.array) -> mx.array:
        """The Window's backend (CPU, or Metal with experts="metal"): x read in place, ids to
        the host, each (token, k) expert output back to MLX in the switch's shape
        [..., k, hidden] and x's dtype, as the model's own SwitchGLU returns it."""
        self._begin(layer)
        indices = self._routed_ids(layer, x, indices)
        # Row-major as the engine reads it (a no-op for the contiguous activations mlx-lm has).
        flat = mx.contiguous(x.reshape(-1, self.hidden))
        rows = flat.shape[0]
        ids2 = indices.reshape(-1, self.top_k)
        if ids2.shape[0] != rows:
            raise ConfigError(
                f"MoE block {layer}: {rows} rows of input for {ids2.shape[0]} rows of expert ids"
            )
        preds = self.predictions(layer, x, rows)
        mx.eval(flat, ids2, *[p for p in preds if p is not None])
        out = self.window.moe_routed(
            layer,
            flat,  # read without a copy through the buffer protocol
            _ids(ids2),
            None,  # per entry, unweighted: the block weights and sums them itself
            pred1=None if preds[0] is None else _ids(preds[0]),
            pred2=None if preds[1] is None else _ids(preds[1]),
            arithmetic=self.arithmetic_for(x.dtype, layer),
            per_entry=True,
        )
        # Each entry comes back in float32, already rounded as MLX rounds x's dtype.
        return mx.array(out).reshape(*indices.shape, self.hidden).astype(x.dtype)

    def arithmetic_for(self, dtype: mx.Dtype, layer: int) -> str:
        """The Window's arithmetic at `layer` for activations of `dtype` (see ARITHMETICS)."""
        if self.arithmetic == "float32":
            return "float32"
        if dtype in self.mlx_dtypes[layer]:
            return "mlx"
        if self.arithmetic == "mlx":
            raise ConfigError(
                "arithmetic='mlx' needs activations in "
                f"{' or '.join(str(d) for d in self.mlx_dtypes[layer])} for this pack, got "
                f"{dtype}"
            )
        return "float32"

    def run_mlx(
        self,
        layer: int,
        x: mx.array,
        indices: mx.array,
        compute: Callable[[mx.array, dict[tuple[int, str], mx.array]], mx.array],
    ) -> mx.array:
        """MLX kernels: compute(slot_indices, views) -> per-expert outputs, once per wave, with
        the slot ids as gather indices; waves merged row by row (each output row depends only
        on its own token and expert, so the result is bitwise the unstreamed one)."""
        assert self.arena is not None
        self._begin(layer)
        indices = self._routed_ids(layer, x, indices)
        rows = int(np.prod(indices.shape[:-1]))
        preds = self.predictions(layer, x, rows)
        mx.eval(indices, *[p for p in preds if p is not None])
        ids = _ids(indices.reshape(-1, self.top_k))
        k = self.top_k
        result: list[mx.array | None] = [None]

        def wave(row0: int, n: int, slots: npt.NDArray[np.uint32]) -> None:
            full = np.zeros((rows, k), np.uint32)
            mask = np.zeros((rows, k), bool)
            valid = slots != np.uint32(ABSENT)
            full[row0 : row0 + n][valid] = slots[valid]
            mask[row0 : row0 + n] = valid
            assert self.arena is not None
            base = self.arena.base()
            y = compute(mx.array(full).reshape(indices.shape), self.arena.views(base, layer))
            prev = result[0]
            if prev is not None or not mask.all():
                m = mx.array(mask).reshape(*indices.shape, 1)
                y = mx.where(m, y, prev if prev is not None else mx.zeros_like(y))
            # Evaluated before returning: the slots stay valid only until this wave ends.
            mx.eval(y)
            result[0] = y

        self.window.moe_routed_external(
            layer,
            ids,
            wave,
            pred1=None if preds[0] is None else _ids(preds[0]),
            pred2=None if preds[1] is None else _ids(preds[1]),
        )
        out = result[0]
        assert out is not None
        return out


def _ids(a: mx.array) -> npt.NDArray[np.int32]:
    return np.asarray(a).astype(np.int32, copy=False)
