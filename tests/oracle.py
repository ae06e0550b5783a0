"""Independent numpy reference of one MoE block, written from the model equations.

Qwen3-MoE and OLMoE ("softmax_topk"): p = softmax(x @ router.T) over all experts, keep the top k,
optionally renormalise them to sum 1 (norm_topk_prob). Mixtral ("topk_softmax"): keep the top k
logits and softmax over just those. Each expert is a SwiGLU FFN,
y = down @ (silu(gate @ x) * (up @ x)), and the block output is sum_k w_k * y_k.

`moce_reference` is the cache-aware routing selection (docs/architecture.md section 6) written
from its spec, and `moe_reference_selected` the block evaluated with a given selection.

This deliberately shares no code with the engine or the pack reader: it is what engine output is
compared against, so a bug here must not be able to hide the same bug there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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


@dataclass(frozen=True)
class OaiExperts:
    """gpt-oss's experts: the clamped SwiGLU's alpha and limit, and biases(e) -> (gate, up,
    down) Linear biases."""

    alpha: float
    limit: float
    biases: Callable[[int], tuple[F32, F32, F32]]


def moe_reference(
    x: F32,
    router: F32,
    experts: ExpertFn,
    top_k: int,
    routing: str,
    norm_topk_prob: bool,
    oai: OaiExperts | None = None,
) -> F32:
    """Block output [T, hidden] float32 for x [T, hidden]; experts(e) -> (gate, up, down).
    With `oai`, gpt-oss's experts: (clip(u + bu) + 1) * g' * sigmoid(alpha g'), g' = min(g + bg,
    limit), then down h + bd."""
    ids, w = route_reference(x, router, top_k, routing, norm_topk_prob)
    return _mixture(x, experts, ids, w, oai)


def _mixture(
    x: F32, experts: ExpertFn, ids: npt.NDArray[np.int32], w: F32, oai: OaiExperts | None = None
) -> F32:
    x64 = np.asarray(x, np.float64)
    out = np.zeros(x64.shape, np.float64)
    # Loading an expert can be costly (a pack read), so fetch each chosen one once and run it on
    # all the tokens that picked it.
    for e in np.unique(ids):
        rows, slots = np.nonzero(ids == e)
        gate, up, down = (np.asarray(m, np.float64) for m in experts(int(e)))
        xe = x64[rows]
        if oai is None:
            y = (_silu(xe @ gate.T) * (xe @ up.T)) @ down.T
        else:
            bg, bu, bd = (np.asarray(b, np.float64) for b in oai.biases(int(e)))
            g = np.minimum(xe @ gate.T + bg, oai.limit)
            u = np.clip(xe @ up.T + bu, -oai.limit, oai.limit)
            y = ((u + 1) * g / (1 + np.exp(-oai.alpha * g))) @ down.T + bd
        out[rows] += w[rows, slots, None].astype(np.float64) * y
    return out.astype(np.float32)


# ---- moce: cache-aware routing (docs/architecture.md section 6) ---------------------------


def moce_reference(
    x: F32,
    router: F32,
    top_k: int,
    resident: npt.NDArray[np.bool_],
    mode: str,
    strength: float,
    keep_top: int,
) -> tuple[npt.NDArray[np.int32], F64, npt.NDArray[np.int64]]:
    """The moce selection from the spec: ids [T, k] in true-rank order, and per token the true
    probability mass of the true top-k experts it dropped and how many it dropped.

    p = softmax over every expert (whatever the routing rule). True rank: logit descending, ties
    to the lower index. The true top keep_top always stay. scale: the other places go to the best
    of p * (strength if resident else 1), ties by true rank. prune: walking the true top-k after
    keep_top from the weakest up, a nonresident choice with p < strength is replaced by the
    best-ranked resident expert outside the true top-k not used yet, while there is one.
    """
    logits = (np.asarray(x, np.float64) @ np.asarray(router, np.float64).T).astype(np.float32)
    p = _softmax64(logits.astype(np.float64))
    n_tokens, n_experts = logits.shape
    j_keep = min(keep_top, top_k)
    ids = np.empty((n_tokens, top_k), np.int32)
    moved = np.zeros(n_tokens, np.float64)
    changed = np.zeros(n_tokens, np.int64)
    for t in range(n_tokens):
        rank = [int(e) for e in np.argsort(-logits[t], kind="stable")]
        position = {e: r for r, e in enumerate(rank)}
        chosen = rank[:top_k]
        if mode == "scale":
            rest = rank[j_keep:]
            score = {e: p[t, e] * (strength if resident[e] else 1.0) for e in rest}
            rest.sort(key=lambda e: (-score[e], position[e]))
            chosen = rank[:j_keep] + rest[: top_k - j_keep]
        elif mode == "prune":
            spare = [e for e in rank[top_k:] if resident[e]]
            for j in reversed(range(j_keep, top_k)):
                e = chosen[j]
                if not resident[e] and p[t, e] < strength and spare:
                    chosen[j] = spare.pop(0)
        elif mode != "off":
            raise ValueError(f"unknown moce mode {mode!r}")
        chosen.sort(key=lambda e: position[e])
        ids[t] = chosen
        dropped = [e for e in rank[:top_k] if e not in chosen]
        moved[t] = sum(p[t, e] for e in dropped)
        changed[t] = len(dropped)
    return ids, moved, changed


def moe_reference_selected(
    x: F32,
    router: F32,
    experts: ExpertFn,
    ids: npt.NDArray[np.int32],
    routing: str,
    norm_topk_prob: bool,
) -> F32:
    """Block output with the experts `ids` [T, k] chosen instead of the top-k, weighted by the
    model's own rule over their true router values: softmax_topk takes their softmax-over-all
    probabilities (renormalised to sum 1 when norm_topk_prob); topk_softmax the softmax over
    their logits."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    logits = (np.asarray(x, np.float64) @ np.asarray(router, np.float64).T).astype(np.float32)
    picked = np.take_along_axis(logits, ids.astype(np.int64), axis=-1).astype(np.float64)
    if routing == "softmax_topk":
        probs = _softmax64(logits.astype(np.float64))
        w = np.take_along_axis(probs, ids.astype(np.int64), axis=-1)
        if norm_topk_prob:
            w = w / w.sum(axis=-1, keepdims=True)
    else:
        w = _softmax64(picked)
    return _mixture(x, experts, ids, w.astype(np.float32))
