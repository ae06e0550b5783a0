"""Independent numpy reference of one MoE block, written from the model equations.

Qwen3-MoE and OLMoE ("softmax_topk"): p = softmax(x @ router.T) over all experts, keep the top k,
optionally renormalise them to sum 1 (norm_topk_prob). Mixtral ("topk_softmax"): keep the top k
logits and softmax over just those. Each expert is a SwiGLU FFN,
y = down @ (silu(gate @ x) * (up @ x)), and the block output is sum_k w_k * y_k.

This deliberately shares no code with the engine or the pack reader: it is what engine output is
compared against, so a bug here must not be able to hide the same bug there.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]
ExpertFn = Callable[[int], tuple[F32, F32, F32]]

ROUTINGS = ("softmax_topk", "topk_softmax")


def _softmax64(z: F64) -> F64:
    # Shift by the row max so exp cannot overflow; the result is unchanged mathematically.
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    out: F64 = e / e.sum(axis=-1, keepdims=True)
    return out


def _top(scores: F32, k: int) -> npt.NDArray[np.int64]:
    # A stable sort on the negated scores keeps equal scores in index order: lower index wins.
    order = np.argsort(-scores, axis=-1, kind="stable")
    out: npt.NDArray[np.int64] = order[:, :k]
    return out


def route_reference(
    x: F32, router: F32, top_k: int, routing: str, norm_topk_prob: bool
) -> tuple[npt.NDArray[np.int32], F32]:
    """Chosen experts (ids [T, k] int32, best first) and their weights ([T, k] float32)."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    x64 = np.asarray(x, np.float64)
    r64 = np.asarray(router, np.float64)
    # The models hold router logits and probabilities in float32; rank on those float32 values
    # so that ties (and near-ties rounded to ties) break the way a float32 engine sees them.
    logits = (x64 @ r64.T).astype(np.float32)
    if routing == "softmax_topk":
        probs = _softmax64(logits.astype(np.float64)).astype(np.float32)
        ids = _top(probs, top_k)
        w = np.take_along_axis(probs, ids, axis=-1).astype(np.float64)
        if norm_topk_prob:
            w = w / w.sum(axis=-1, keepdims=True)
    else:
        ids = _top(logits, top_k)
        w = _softmax64(np.take_along_axis(logits, ids, axis=-1).astype(np.float64))
    return ids.astype(np.int32), w.astype(np.float32)


def _silu(z: F64) -> F64:
    out: F64 = z / (1.0 + np.exp(-z))
    return out


def moe_reference(
    x: F32,
    router: F32,
    experts: ExpertFn,
    top_k: int,
    routing: str,
    norm_topk_prob: bool,
) -> F32:
    """Block output [T, hidden] float32 for x [T, hidden]; experts(e) -> (gate, up, down)."""
    x64 = np.asarray(x, np.float64)
    ids, w = route_reference(x, router, top_k, routing, norm_topk_prob)
    out = np.zeros(x64.shape, np.float64)
    # Loading an expert can be costly (a pack read), so fetch each chosen one once and run it on
    # all the tokens that picked it.
    for e in np.unique(ids):
        rows, slots = np.nonzero(ids == e)
        gate, up, down = (np.asarray(m, np.float64) for m in experts(int(e)))
        xe = x64[rows]
        y = (_silu(xe @ gate.T) * (xe @ up.T)) @ down.T
        out[rows] += w[rows, slots, None].astype(np.float64) * y
    return out.astype(np.float32)
