"""Which experts layer l+1 (and l+2) will choose, from layer l's input: the engine's lookahead.

The residual stream changes little from one layer to the next, so a block's own routing applied
to the previous block's input predicts its choice well. The routing is reached by structure,
never by a copy of the family's code:

- "router": the block's own ``__call__`` runs on the input with its streamed switch in capture
  mode (`Captured`): the block routes exactly as it will (softmax or sigmoid, correction
  biases, group-limited top-k, whatever its code does) and the switch hands back the ids before
  any expert is computed. MLX is lazy: nothing after the switch call is ever evaluated.
- "gate": a block whose ``__call__`` cannot run on the input alone (its router lives in the
  decoder layer, say) may still hold a router module (``gate``/``router``): its output is read
  by shape, ids ``[..., k]`` or logits ``[..., n_experts]`` (top-k taken).
- "profile": neither works; the engine then queues the layer's most used experts (its profile
  fallback), and `describe()` says so per layer.

A prediction only decides what is read early: a wrong one costs IO, never output (the switch
computes the ids the block gives it; tests/test_mlx_lm_families.py corrupts the predictor and
checks the output bits).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

METHODS = ("router", "gate", "profile")
_ROUTER_NAMES = ("gate", "router")


def _ids(got: Any, top_k: int, n_experts: int) -> mx.array | None:
    """ids [..., top_k] from a router module's output, read by shape; None if it holds none."""
    outputs = got if isinstance(got, (tuple, list)) else (got,)
    for out in outputs:
        if not isinstance(out, mx.array) or out.ndim < 1:
            continue
        if out.shape[-1] == top_k and mx.issubdtype(out.dtype, mx.integer):
            return out
    for out in outputs:
        if not isinstance(out, mx.array) or out.ndim < 1:
            continue
        if out.shape[-1] == n_experts and mx.issubdtype(out.dtype, mx.floating):
            return mx.argpartition(-out.astype(mx.float32), kth=top_k - 1, axis=-1)[..., :top_k]
    return None


class Captured(Exception):  # noqa: N818 - a control-flow signal, not an error
    """Raised by a streamed switch in capture mode: the ids its block's own routing chose."""

    def __init__(self, indices: mx.array) -> None:
        super().__init__("captured")
        self.indices = indices


class Predictor:
    """Predicts one pack layer's ids from an input, by the first method that works for it."""

    def __init__(
        self, block: Any, stand_in: Any, decoder_layer: Any, top_k: int, n_experts: int
    ) -> None:
        self.block = block  # the module whose __call__ calls the switch
        self.stand_in = stand_in  # the streamed switch (capture mode)
        self.decoder_layer = decoder_layer  # where a router may live outside the block
        self.top_k = top_k
        self.n_experts = n_experts
        self.method: str | None = None  # decided at the first prediction
        self.why = ""  # why "router" did not work, when it did not
        self.failures = 0  # predictions that raised after the method was chosen (none made)

    def __call__(self, x: mx.array) -> mx.array | None:
        """[rows, top_k] ids (unevaluated), or None (profile)."""
        if self.method is None:
            self.method = self._choose(x)
        try:
            if self.method == "router":
                got = self._captured(x)
            elif self.method == "gate":
                got = self._gated(x)
            else:
                return None
        except Exception:  # noqa: BLE001 - a prediction may fail; the layer call may not
            self.failures += 1
            return None
        return None if got is None else got.reshape(-1, self.top_k)

    def _choose(self, x: mx.array) -> str:
        try:
            if self._captured(x) is not None:
                return "router"
            self.why = "the block's routing gave no ids of the pack's top-k"
        except Exception as e:  # noqa: BLE001 - any failure means: not this way
            self.why = f"{type(e).__name__}: {e}"
        try:
            if self._gated(x) is not None:
                return "gate"
        except Exception:  # noqa: BLE001, S110 - as above
            pass
        return "profile"

    def _captured(self, x: mx.array) -> mx.array | None:
        # The switch's input may be the block's flattened ([T, H] of a [B, L, H] block input:
        # olmoe): a block that cannot take it as it is gets it with a batch axis back.
        try:
            return self._capture(x)
        except Exception:
            if x.ndim != 2:
                raise
            return self._capture(x[None])

    def _capture(self, x: mx.array) -> mx.array | None:
        self.stand_in.capture = True
        try:
            self.block(x)
        except Captured as c:
            ids = c.indices
            ok = ids.ndim >= 1 and ids.shape[-1] == self.top_k
            return ids if ok else None
        finally:
            self.stand_in.capture = False
        return None

    def _router(self) -> Callable[[mx.array], Any] | None:
        for owner in (self.block, self.decoder_layer):
            if owner is None:
                continue
            for name in _ROUTER_NAMES:
                module = owner.get(name) if hasattr(owner, "get") else None
                if module is not None and callable(module) and module is not self.stand_in:
                    router: Callable[[mx.array], Any] = module
                    return router
        return None

    def _gated(self, x: mx.array) -> mx.array | None:
        router = self._router()
        if router is None:
            return None
        return _ids(router(x), self.top_k, self.n_experts)
