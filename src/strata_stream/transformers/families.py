"""Which transformers MoE blocks stream, and how each one's router is reached.

In transformers 5 a sparse block routes with its own router module and then calls
``self.experts(hidden_states, top_k_index, top_k_weights)``: that call is the seam, so only the
experts module is replaced (loader.py) and routing, mixture weights, shared experts and the
rest of the block stay the model's own code. The router is also what predicts: layer l+1's
router applied to layer l's input (engine.py). Every supported router returns
``(router_logits, top_k_weights, top_k_index)``.

Supported block classes (by name, so a family is found whatever module defines it):
Qwen3MoeSparseMoeBlock, MixtralSparseMoeBlock, OlmoeSparseMoeBlock, Qwen2MoeSparseMoeBlock
(shared expert with a sigmoid gate, kept dense in torch), DeepseekV3MoE (sigmoid scoring,
correction bias, group-limited top-k, routed scaling, shared experts), GptOssMLP (router bias;
its experts' biases and clamped SwiGLU are in the pack).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from strata_stream.errors import ConfigError


@dataclass(frozen=True)
class Family:
    name: str
    router_attr: str  # the block's router module
    # The experts module's fused gate_up_proj is [E, H, 2I] (gpt-oss) rather than [E, 2I, H].
    hidden_first: bool = False


_BY_CLASS: dict[str, Family] = {
    "Qwen3MoeSparseMoeBlock": Family("qwen3_moe", "gate"),
    "MixtralSparseMoeBlock": Family("mixtral", "gate"),
    "OlmoeSparseMoeBlock": Family("olmoe", "gate"),
    "Qwen2MoeSparseMoeBlock": Family("qwen2_moe", "gate"),
    "DeepseekV3MoE": Family("deepseek_v3", "gate"),
    "GptOssMLP": Family("gpt_oss", "router", hidden_first=True),
}


def family_of(block: Any) -> Family:
    """The Family of a sparse MoE block; ConfigError for blocks not supported yet."""
    name = type(block).__name__
    family = _BY_CLASS.get(name)
    if family is None:
        raise ConfigError(
            f"MoE block {type(block).__module__}.{name} is not supported yet (supported: "
            f"{', '.join(sorted(_BY_CLASS))})"
        )
    return family


def is_sparse_block(module: Any) -> bool:
    """A module that routes with its own router and calls a fused experts module."""
    import torch

    experts = getattr(module, "experts", None)
    if not isinstance(experts, torch.nn.Module) or not hasattr(experts, "gate_up_proj"):
        return False
    return any(isinstance(getattr(module, a, None), torch.nn.Module) for a in ("gate", "router"))


def experts_shape(block: Any, family: Family) -> tuple[int, int, int]:
    """(n_experts, moe_intermediate, hidden) of a block's (still unreplaced) experts module."""
    e, a, b = block.experts.gate_up_proj.shape
    if family.hidden_first:
        return int(e), int(b) // 2, int(a)
    return int(e), int(a) // 2, int(b)


def route_ids(block: Any, family: Family, x: Any) -> Any:
    """The expert ids block's own router picks for x [T, H] ([T, k]). Called through forward,
    not __call__: transformers records router outputs with module hooks
    (output_router_logits), and a prediction is not one of the model's routings."""
    router = getattr(block, family.router_attr)
    return type(router).forward(router, x)[2]
