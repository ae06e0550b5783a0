"""The modules that take the place of an mlx-lm MoE block's routed experts.

CPU-backend path: `StreamedMoE` replaces the block in its decoder layer. It routes with the
block's own gate (families.py), hands ids and weights to the engine, which streams and computes
the experts on the CPU backend reading x in place, and adds the block's dense shared experts.

MLX-kernel path: `StreamedExperts` replaces only the block's SwitchGLU, so the block's own
__call__ (routing, mixture, shared experts) runs unchanged. It keeps the SwitchGLU's structure
(its SwitchLinear/QuantizedSwitchLinear modules and activation) with the expert tensors taken
out, and per wave lends it views of the arena with the slot ids as indices: mlx-lm's own
gather_qmm/gather_mm code on the same bytes, hence bitwise the unstreamed output.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from strata_stream.mlx_lm.engine import BlockRef, MoeEngine

_PARAM_KEYS = ("weight", "scales", "biases", "bias")
_MATRICES = ("gate_proj", "up_proj", "down_proj")


def strip_experts(switch: Any) -> None:
    """Drops the expert tensors of a SwitchGLU so that MLX never reads them (they stay lazy and
    unreferenced: evaluating the model's parameters no longer touches the expert shards)."""
    for name in _MATRICES:
        linear = switch[name]
        for key in _PARAM_KEYS:
            if key in linear:
                linear.pop(key)


class StreamedExperts(nn.Module):  # type: ignore[misc,name-defined]
    """Stands in for a block's SwitchGLU on the MLX-kernel path."""

    def __init__(self, engine: MoeEngine, ref: BlockRef, switch: Any) -> None:
        super().__init__()
        strip_experts(switch)
        # Held outside the module tree: it has no parameters left, and must not gain any in
        # model.parameters() while it borrows the arena views.
        object.__setattr__(self, "_switch", switch)
        object.__setattr__(self, "_engine", engine)
        object.__setattr__(self, "_ref", ref)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        switch: Any = self._switch

        def compute(slot_indices: mx.array, views: dict[tuple[int, str], mx.array]) -> mx.array:
            for (m, key), view in views.items():
                switch[_MATRICES[m]][key] = view
            try:
                y: mx.array = switch(x, slot_indices)
            finally:
                strip_experts(switch)
            return y

        out: mx.array = self._engine.run_mlx(self._ref.layer, x, indices, compute)
        return out


class StreamedMoE(nn.Module):  # type: ignore[misc,name-defined]
    """Stands in for a whole MoE block on the CPU-backend path."""

    def __init__(self, engine: MoeEngine, ref: BlockRef) -> None:
        super().__init__()
        block = ref.block
        switch = block[ref.family.experts_attr]
        strip_experts(switch)
        # The block stays a child (its gate and shared experts are model parameters).
        self.block = block
        object.__setattr__(self, "_engine", engine)
        object.__setattr__(self, "_ref", ref)

    def __call__(self, x: mx.array) -> mx.array:
        ref: BlockRef = self._ref
        block: Any = self.block
        shape = x.shape
        xr = x.reshape(-1, shape[-1]) if ref.family.flat else x
        inds, scores = ref.family.route(block, xr)
        y = self._engine.run_cpu(ref.layer, xr, inds, scores)
        y = ref.family.finish(block, xr, y)
        # Tensor parallel (mlx-lm's model.shard): this rank's experts and shared experts are
        # its slice, so the block's partial output is summed over the group exactly where
        # mlx-lm's block sums it, after the shared experts; nothing else crosses the network.
        group = getattr(block, "sharding_group", None)
        if group is not None:
            y = mx.distributed.all_sum(y, group=group)
        return y.reshape(shape)
