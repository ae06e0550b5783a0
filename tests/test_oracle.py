"""The MoE oracle against cases worked out by hand."""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt
import pytest

from oracle import moe_reference, route_reference

F32 = npt.NDArray[np.float32]

# One token, hidden 2, four experts with logits [2, 1, 0, -1] for x = [1, 0].
X = np.array([[1.0, 0.0]], np.float32)
ROUTER = np.array([[2, 0], [1, 0], [0, 0], [-1, 0]], np.float32)


def expert(e: int) -> tuple[F32, F32, F32]:
    # Intermediate width 1: gate picks x[0], up scales it by e + 1, down writes [1, 2].
    gate = np.array([[1.0, 0.0]], np.float32)
    up = np.array([[e + 1.0, 0.0]], np.float32)
    down = np.array([[1.0], [2.0]], np.float32)
    return gate, up, down


def test_softmax_topk_hand_computed() -> None:
    total = sum(math.exp(z) for z in (2, 1, 0, -1))
    p0, p1 = math.exp(2) / total, math.exp(1) / total
    silu1 = 1.0 / (1.0 + math.exp(-1.0))
    for norm, (w0, w1) in ((False, (p0, p1)), (True, (p0 / (p0 + p1), p1 / (p0 + p1)))):
        ids, w = route_reference(X, ROUTER, 2, "softmax_topk", norm)
        assert ids.dtype == np.int32 and w.dtype == np.float32
        assert ids.tolist() == [[0, 1]]
        np.testing.assert_allclose(w, [[w0, w1]], rtol=1e-6)
        # y_e = down * silu(1) * (e + 1): expert 0 gives silu(1) [1, 2], expert 1 twice that.
        y = moe_reference(X, ROUTER, expert, 2, "softmax_topk", norm)
        assert y.dtype == np.float32 and y.shape == (1, 2)
        np.testing.assert_allclose(y, [[silu1 * (w0 + 2 * w1) * k for k in (1, 2)]], rtol=1e-6)


def test_topk_softmax_hand_computed() -> None:
    # Softmax over the two best logits only: the weights no longer see experts 2 and 3.
    ids, w = route_reference(X, ROUTER, 2, "topk_softmax", False)
    assert ids.tolist() == [[0, 1]]
    e = math.exp(1.0)
    np.testing.assert_allclose(w, [[e / (e + 1), 1 / (e + 1)]], rtol=1e-6)


@pytest.mark.parametrize("routing", ["softmax_topk", "topk_softmax"])
def test_ties_go_to_the_lower_index(routing: str) -> None:
    tied = np.array([[0, 0], [1, 0], [1, 0], [0.5, 0]], np.float32)
    ids, w = route_reference(X, tied, 1, routing, True)
    assert ids.tolist() == [[1]]
    ids, w = route_reference(X, tied, 3, routing, True)
    assert ids.tolist() == [[1, 2, 3]]
    assert w[0, 0] == w[0, 1]
    # A zero input ties every expert: the choice is simply the first k.
    ids, w = route_reference(np.zeros((1, 2), np.float32), tied, 2, routing, False)
    assert ids.tolist() == [[0, 1]]


def test_tokens_are_independent() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 8)).astype(np.float32)
    router = rng.standard_normal((6, 8)).astype(np.float32)

    def experts(e: int) -> tuple[F32, F32, F32]:
        r = np.random.default_rng(e)
        g, u, d = (r.standard_normal(s).astype(np.float32) for s in ((3, 8), (3, 8), (8, 3)))
        return g, u, d

    # Grouping tokens by expert must not mix them up: the batch equals one token at a time.
    y = moe_reference(x, router, experts, 2, "softmax_topk", True)
    for t in range(5):
        yt = moe_reference(x[t : t + 1], router, experts, 2, "softmax_topk", True)
        np.testing.assert_allclose(y[t : t + 1], yt, rtol=1e-6)
