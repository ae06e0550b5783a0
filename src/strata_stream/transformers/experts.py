"""The module that takes the place of a sparse block's experts module.

It has no parameters (only empty stand-ins for the experts' weights, for the model's weight
init to touch): the block's router and shared experts stay the model's, and the routed
experts live in the pack. Its call is the experts module's own signature, ``(hidden_states
[T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``; the engine streams and computes
the chosen experts (engine.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from strata_stream.transformers.engine import TorchMoeEngine


class EngineSlot:
    """Where the streamed modules find the engine: it is made after the dense weights load
    (the arena is sized from the memory left), so the modules are built before it exists."""

    def __init__(self) -> None:
        self.engine: TorchMoeEngine | None = None
        # (decoder layer, path, block, family, (n_experts, moe_intermediate, hidden)) per block.
        self.blocks: list[tuple[Any, ...]] = []


class StreamedExperts(torch.nn.Module):
    """Stands in for one sparse block's experts module (pack layer `layer`)."""

    def __init__(self, slot: EngineSlot, layer: int, n_experts: int) -> None:
        super().__init__()
        self._slot = slot
        self.layer = layer
        self.num_experts = n_experts
        # Empty stand-ins for the experts interface's weights, plain attributes (no parameters,
        # nothing in the state dict): some models' _init_weights initialise
        # `block.experts.gate_up_proj` during from_pretrained (qwen3_omni_moe's thinker), and
        # an initialiser on an empty tensor is a no-op. Nothing computes with them.
        self.gate_up_proj = torch.empty(0)
        self.up_proj = torch.empty(0)  # gateless experts' (nemotron_h)
        self.down_proj = torch.empty(0)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        engine = self._slot.engine
        if engine is None:
            raise RuntimeError("the streamed experts ran before strata_stream.transformers.load "
                               "made their engine")  # fmt: skip
        return engine.run(self.layer, hidden_states, top_k_index, top_k_weights)

    def extra_repr(self) -> str:
        return f"layer={self.layer}, num_experts={self.num_experts}, streamed"
