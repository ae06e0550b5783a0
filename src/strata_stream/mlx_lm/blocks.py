"""The module that takes the place of an mlx-lm MoE block's routed experts, on both paths.

mlx-lm's MoE blocks all route with their own code and then call their experts module, a
`SwitchGLU` (or `SwitchMLP`): ``switch(x, indices)`` returns every (token, k) expert output,
``[..., k, hidden]``, which the block weights, sums and finishes (shared experts, scaling) in
its own way. That call is the seam: `StreamedSwitch` replaces the switch alone, so the model's
own block code routes, weights and finishes unchanged, whatever the family.

- CPU-backend path: the ids go to the engine, which streams the experts in and computes each
  entry on the Window's backend with MLX's own arithmetic (engine.py), and the per-entry
  outputs come back in the switch's shape and dtype.
- MLX-kernel path: the switch's own modules (SwitchLinear/QuantizedSwitchLinear and its
  activation) run over views of the arena, lent per wave with the slot ids as gather indices:
  mlx-lm's own gather_qmm/gather_mm code on the same bytes, hence bitwise the unstreamed output.

A switch whose activation the CPU backend does not compute takes the MLX-kernel path whatever
was asked (`cpu_activation`): the pack's activation is checked against the module's own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn

from strata_stream.mlx_lm.prediction import Captured

if TYPE_CHECKING:
    from strata_stream.mlx_lm.engine import BlockRef, MoeEngine

_PARAM_KEYS = ("weight", "scales", "biases", "bias")
# The pack's three matrices, by the switch's own module names.
GLU_MATRICES = ("gate_proj", "up_proj", "down_proj")


def switch_classes() -> tuple[type, ...]:
    """mlx-lm's experts modules: the seam every MoE block calls."""
    from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

    return (SwitchGLU, SwitchMLP)


def is_glu(switch: Any) -> bool:
    from mlx_lm.models.switch_layers import SwitchGLU

    return isinstance(switch, SwitchGLU)


def strip_experts(switch: Any) -> None:
    """Drops the expert tensors of a switch so that MLX never reads them (they stay lazy and
    unreferenced: evaluating the model's parameters no longer touches the expert shards)."""
    for name in GLU_MATRICES:
        if name not in switch:
            continue
        linear = switch[name]
        for key in _PARAM_KEYS:
            if key in linear:
                linear.pop(key)


def cpu_activation(switch: Any) -> tuple[str, float, float] | None:
    """The pack activation (name, alpha, limit) the CPU backend computes for this switch's own
    activation module, or None when it computes none of it (the MLX-kernel path then runs the
    module itself). By exact class: a subclass may change the arithmetic."""
    from mlx_lm.models.activations import SwigluOAI
    from mlx_lm.models.switch_layers import SwiGLU

    if not is_glu(switch):
        return None
    act = switch.activation
    if type(act) is SwiGLU:
        return ("swiglu", 0.0, 0.0)
    if type(act) is SwigluOAI:
        # Its constants, as SwigluOAI keeps them (underscored in mlx-lm 0.32).
        alpha = act.__dict__.get("_alpha", getattr(act, "alpha", None))
        limit = act.__dict__.get("_limit", getattr(act, "limit", None))
        if alpha is None or limit is None:
            return None
        return ("swiglu_oai", float(alpha), float(limit))
    return None


class StreamedSwitch(nn.Module):  # type: ignore[misc,name-defined]
    """Stands in for a block's SwitchGLU: ``(x, indices) -> [..., k, hidden]`` in x's dtype."""

    def __init__(self, engine: MoeEngine, ref: BlockRef, switch: Any, kernels: str) -> None:
        super().__init__()
        strip_experts(switch)
        # Held outside the module tree: it has no parameters left, and must not gain any in
        # model.parameters() while it borrows the arena views.
        object.__setattr__(self, "_switch", switch)
        object.__setattr__(self, "_engine", engine)
        object.__setattr__(self, "_ref", ref)
        object.__setattr__(self, "kernels", kernels)  # "cpu" (the Window's backend) or "mlx"
        object.__setattr__(self, "capture", False)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        if self.capture:
            # A prediction runs the block's own routing up to here (engine.predictions).
            raise Captured(indices)
        engine: MoeEngine = self._engine
        layer = self._ref.layer
        if self.kernels == "cpu":
            return engine.run_cpu(layer, x, indices)
        switch: Any = self._switch

        def compute(slot_indices: mx.array, views: dict[tuple[int, str], mx.array]) -> mx.array:
            for (m, key), view in views.items():
                switch[GLU_MATRICES[m]][key] = view
            try:
                y: mx.array = switch(x, slot_indices)
            finally:
                strip_experts(switch)
            return y

        return engine.run_mlx(layer, x, indices, compute)
