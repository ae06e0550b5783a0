"""The modules that take the place of a sparse block's experts module.

Two kinds, by what the experts module is (families.py):

- `StreamedExperts`, for an experts module whose forward is the experts interface's dispatch
  (almost every family). It has no parameters (only empty stand-ins for the experts' weights,
  for the model's weight init to touch): the block's router and shared experts stay the
  model's, and the routed experts live in the pack. Its call is the experts module's own
  signature, ``(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``;
  the engine streams and computes the chosen experts (engine.py). Where the interface applies
  a norm to each route's output (``has_post_expert_norm``: muse_spark), the module keeps the
  experts module's own ``post_expert_norm`` (loaded by from_pretrained under its own name, so
  its weights are resident and counted with the dense ones) and the engine applies it to the
  streamed per-route outputs before the mixture weights.
- The experts module itself, for a class with a forward of its own around the interface
  class's dispatch (ergo: ``ErgoExperts(ErgoExpertProjections)``, the projections class being
  the decorated one): its class becomes a subclass whose MRO puts a streamed dispatch between
  the class's own forward and the interface class, and its projections are dropped. The
  model's own forward then runs unchanged, its ``super().forward(...)`` streamed, and its own
  modules (ergo's per-expert norm) stay the model's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from strata_stream.transformers.families import POST_NORM, PROJECTIONS, Family, interface_class

if TYPE_CHECKING:
    from strata_stream.transformers.engine import TorchMoeEngine


class EngineSlot:
    """Where the streamed modules find the engine: it is made after the dense weights load
    (the arena is sized from the memory left), so the modules are built before it exists."""

    def __init__(self) -> None:
        self.engine: TorchMoeEngine | None = None
        # (decoder layer, path, block, family, (n_experts, moe_intermediate, hidden)) per block.
        self.blocks: list[tuple[Any, ...]] = []


def _engine(slot: EngineSlot) -> TorchMoeEngine:
    engine = slot.engine
    if engine is None:
        raise RuntimeError("the streamed experts ran before strata_stream.transformers.load "
                           "made their engine")  # fmt: skip
    return engine


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
        return _engine(self._slot).run(self.layer, hidden_states, top_k_index, top_k_weights)

    def extra_repr(self) -> str:
        return f"layer={self.layer}, num_experts={self.num_experts}, streamed"


def _streamed_dispatch(
    self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The interface class's dispatch, streamed: what any of its backends returns."""
    return _engine(self._strata_slot).run(
        self._strata_layer, hidden_states, top_k_index, top_k_weights
    )


def _streamed_repr(self: Any) -> str:
    return f"layer={self._strata_layer}, num_experts={self.num_experts}, streamed dispatch"


def _wrap_dispatch(experts: torch.nn.Module, slot: EngineSlot, layer: int, n_experts: int) -> None:
    """Turns `experts` (a class whose own forward runs around its interface class's dispatch)
    into one whose dispatch is streamed, in place: its class is swapped for a subclass whose
    MRO puts the streamed dispatch right in front of the interface class (so the class's own
    ``super().forward`` reaches it), and its projections are dropped (from_pretrained then
    never reads them; empty stand-ins stay for the model's weight init)."""
    cls = type(experts)
    iface = interface_class(experts)
    assert iface is not None  # families.family_of took the module on
    dispatch = type(
        f"Streamed{iface.__name__}",
        (iface,),
        {"forward": _streamed_dispatch, "__module__": __name__},
    )
    # C3 puts `dispatch` after every class of cls's MRO in front of iface, and before iface.
    streamed = type(
        cls.__name__,
        (cls, dispatch),
        {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
         "extra_repr": _streamed_repr},
    )  # fmt: skip
    experts.__class__ = streamed
    for name in PROJECTIONS:
        if name in experts._parameters:
            del experts._parameters[name]
            setattr(experts, name, torch.empty(0))
    # Plain attributes (nn.Module keeps them in the instance's dict).
    vars(experts).update(_strata_slot=slot, _strata_layer=layer, num_experts=n_experts)


def streamed_experts(
    slot: EngineSlot, layer: int, family: Family, experts: torch.nn.Module
) -> torch.nn.Module:
    """The module that takes `experts`' place (pack layer `layer`): see the module's doc."""
    if family.own_forward:
        _wrap_dispatch(experts, slot, layer, family.n_experts)
        return experts
    streamed = StreamedExperts(slot, layer, family.n_experts)
    if family.post_norm:
        streamed.add_module(POST_NORM, getattr(experts, POST_NORM))
    return streamed
