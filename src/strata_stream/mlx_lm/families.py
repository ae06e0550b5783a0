"""How each mlx-lm MoE block routes and what it adds after its routed experts.

Each `route` repeats its block's own routing lines from mlx-lm 0.32 (mlx_lm/models/<family>.py)
on the block's own gate module, so the selection and the weights are the model's exactly; each
`finish` adds what the block adds to the routed mixture (shared experts, kept dense in MLX). The
CPU-backend path computes routing here, hands ids and weights to the engine and finishes; the
MLX-kernel path runs the block's own __call__ unchanged (see blocks.StreamedExperts).

Supported block classes (by name, so a family is found whatever module defines it):
Qwen3MoeSparseMoeBlock, Qwen3NextSparseMoeBlock, OlmoeSparseMoeBlock, Qwen2MoeSparseMoeBlock,
MixtralSparseMoeBlock, DeepseekV3MoE and every block whose gate returns (inds, scores)
(glm4_moe's MoE, kimi-style MoEGate), gpt_oss's MLPBlock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from strata_stream.errors import ConfigError

Route = Callable[[Any, mx.array], tuple[mx.array, mx.array]]
Finish = Callable[[Any, mx.array, mx.array], mx.array]


@dataclass(frozen=True)
class Family:
    name: str
    experts_attr: str  # the block's SwitchGLU attribute
    route: Route  # (block, x) -> (inds, scores), [..., k] each
    finish: Finish  # (block, x, routed mixture) -> block output
    flat: bool = False  # the block routes x flattened to [T, H] (olmoe)


def _softmax_topk_last(block: Any, x: mx.array) -> tuple[mx.array, mx.array]:
    # qwen3_moe, qwen3_next: softmax (precise), the top k from the end of an argpartition.
    gates = mx.softmax(block.gate(x), axis=-1, precise=True)
    k = block.top_k
    inds = mx.stop_gradient(mx.argpartition(gates, kth=-k, axis=-1)[..., -k:])
    scores = mx.take_along_axis(gates, inds, axis=-1)
    if block.norm_topk_prob:
        scores = scores / mx.sum(scores, axis=-1, keepdims=True)
    return inds, scores


def _softmax_topk_first(block: Any, x: mx.array) -> tuple[mx.array, mx.array]:
    # olmoe, qwen2_moe: softmax (precise), the top k from the front of argpartition(-p).
    gates = mx.softmax(block.gate(x), axis=-1, precise=True)
    k = block.top_k
    inds = mx.stop_gradient(mx.argpartition(-gates, kth=k - 1, axis=-1)[..., :k])
    scores = mx.take_along_axis(gates, inds, axis=-1)
    if getattr(block, "norm_topk_prob", False):
        scores = scores / scores.sum(axis=-1, keepdims=True)
    return inds, scores


def _topk_softmax(block: Any, x: mx.array) -> tuple[mx.array, mx.array]:
    # mixtral: the top k logits, then a softmax over just those.
    gates = block.gate(x)
    k = block.num_experts_per_tok
    inds = mx.stop_gradient(mx.argpartition(-gates, kth=k - 1, axis=-1)[..., :k])
    scores = mx.softmax(mx.take_along_axis(gates, inds, axis=-1), axis=-1, precise=True)
    return inds, scores


def _gate_routes(block: Any, x: mx.array) -> tuple[mx.array, mx.array]:
    # deepseek_v3 / glm4_moe / kimi: MoEGate does everything (sigmoid in fp32, correction bias
    # for selection only, group-limited top-k, renormalisation, routed_scaling_factor).
    inds, scores = block.gate(x)
    return inds, scores


def _gpt_oss(block: Any, x: mx.array) -> tuple[mx.array, mx.array]:
    # gpt_oss: router with bias, top k logits (mlx_topk), softmax over them.
    g = block.router(x)
    k = block.num_experts_per_tok
    inds = mx.stop_gradient(mx.argpartition(g, kth=-k, axis=-1)[..., -k:])
    scores = mx.softmax(mx.take_along_axis(g, inds, axis=-1), axis=-1, precise=True)
    return inds, scores


def _plain(block: Any, x: mx.array, y: mx.array) -> mx.array:
    return y


def _sigmoid_shared(block: Any, x: mx.array, y: mx.array) -> mx.array:
    # qwen2_moe, qwen3_next: a dense shared expert scaled by sigmoid(shared_expert_gate(x)).
    shared: mx.array = mx.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    return y + shared


def _shared_experts(block: Any, x: mx.array, y: mx.array) -> mx.array:
    # deepseek_v3 / glm4_moe: dense shared experts, when the config has them.
    if getattr(block.config, "n_shared_experts", None) is not None:
        shared: mx.array = block.shared_experts(x)
        return y + shared
    return y


_BY_CLASS: dict[str, Family] = {
    "Qwen3MoeSparseMoeBlock": Family("qwen3_moe", "switch_mlp", _softmax_topk_last, _plain),
    "Qwen3NextSparseMoeBlock": Family(
        "qwen3_next", "switch_mlp", _softmax_topk_last, _sigmoid_shared
    ),
    "OlmoeSparseMoeBlock": Family("olmoe", "switch_mlp", _softmax_topk_first, _plain, True),
    "Qwen2MoeSparseMoeBlock": Family(
        "qwen2_moe", "switch_mlp", _softmax_topk_first, _sigmoid_shared
    ),
    "MixtralSparseMoeBlock": Family("mixtral", "switch_mlp", _topk_softmax, _plain),
    "DeepseekV3MoE": Family("deepseek_v3", "switch_mlp", _gate_routes, _shared_experts),
    "MLPBlock": Family("gpt_oss", "experts", _gpt_oss, _plain),
}


def family_of(block: Any) -> Family:
    """The Family of an MoE block; ConfigError for blocks not supported yet."""
    name = type(block).__name__
    family = _BY_CLASS.get(name)
    if family is not None:
        return family
    gate = getattr(block, "gate", None)
    if gate is not None and type(gate).__name__ == "MoEGate" and "switch_mlp" in block:
        # glm4_moe's MoE and other DeepSeek-V3-style blocks.
        return Family(f"deepseek_v3-style ({name})", "switch_mlp", _gate_routes, _shared_experts)
    raise ConfigError(
        f"MoE block {type(block).__module__}.{name} is not supported yet (supported: "
        f"{', '.join(sorted(_BY_CLASS))} and DeepSeek-V3-style MoEGate blocks)"
    )

