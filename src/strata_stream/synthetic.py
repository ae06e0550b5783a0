"""Synthetic residual stream: MoE layer inputs that route like a real model's.

Random inputs route uniformly: every token picks fresh experts, caches rarely hit and running
router l+1 early predicts nothing. Real models differ because the residual stream changes little
per layer (each layer adds an update to it) and consecutive tokens share context. This driver
builds hidden states with those two properties out of the router rows themselves, so it works
whatever the routers are.

For every layer m and token t it picks target router logits

    z_m(t) = pop_m + topics_m(t) + own_m(t) + eps_m(t)

- ``pop_m``: static Zipf-like expert popularity, ``-popularity * ln(1 + rank)``, a random
  ranking per layer;
- ``topics_m(t)``: the summed expert preferences (random normal per topic and layer) of the
  ``n_active`` topics active at token t. A topic stays active from one token to the next with
  probability ``persistence``, else it is replaced by a fresh draw, Zipf-like over ``n_topics``
  so that a few topics keep coming back;
- ``own_m(t)``: fresh normal noise of std ``token_scale`` per token, there from the embedding
  on (so prediction sees it);
- ``eps_m(t)``: two fresh normal pieces of std ``innovation``, one written by layer m - 1 and
  one by layer m itself, the way attention and the previous layer update what layer m's router
  sees.

``D_m`` is a dual basis of router m: ``router_m @ D_m.T = I`` while the routers of the
``LOOK``-nearest layers either side see nothing of it (exactly when ``7 * n_experts <= hidden``,
approximately otherwise). The input of layer l is

    x_l = sum_{d=-1..2} DECAY**|d| * z_{l+d}(t, as far as written by layer l) @ D_{l+d}

so it carries the previous layer's signal and already the next two layers' (without the
innovation they have not written yet). Router l sees exactly z_l; router l+1 on x_l sees
all of z_{l+1} but its last eps piece, router l+2 all of z_{l+2} but both eps pieces:
prediction recall is set by ``innovation`` and degrades with distance, as in real models.

The driver never sees MoE outputs: inputs are a pure function of (geometry, routers, seed,
knobs, call sequence), so it can run standalone to produce routing ids.

Calibration: ``python benchmarks/calibrate_synthetic.py`` routes the Qwen3-30B-A3B geometry
with top-6 and random routers (seed 0) through the real trace's 28 prompt tokens + 128 decode
steps, and replays both through one LRU cache of 1370 slots over all layers, token by token,
layer by layer. The default knobs were tuned for the first two rows (and logit_scale for the
top-1 weight); the rest is for judging:

    ===================================  ==========  ===================================
    metric                                synthetic  real Qwen3-30B-A3B
    ===================================  ==========  ===================================
    LRU hit rate, 1370 slots                  0.761  0.749 (trace)
    next-layer prediction recall              0.890  ~0.89 (reported)
    two-layer prediction recall               0.852  -
    LRU hit rate, prompt / decode       0.71 / 0.77  0.60 / 0.78
    same-layer expert overlap, lag 1          0.366  0.380
    same-layer expert overlap, lag 16         0.268  0.283
    distinct experts per layer, decode         77.7  63.7
    best expert's renormalised weight         0.278  0.272 (logit_scale fits this)
    ===================================  ==========  ===================================

Seeds 1-3 give LRU 0.737-0.747, next-layer recall 0.894-0.895, top-1 weight 0.283-0.286.
The synthetic tail is heavier (more distinct experts) and every layer is alike, where the
trace's first layers route almost uniformly and some middle ones use only ~35 experts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from strata_stream.errors import ConfigError
from strata_stream.pack.geometry import Geometry

F32 = npt.NDArray[np.float32]
I32 = npt.NDArray[np.int32]
I64 = npt.NDArray[np.int64]
RouterSource = Sequence[npt.NDArray[np.floating]] | Callable[[int], npt.NDArray[np.floating]]

# Layer l's input carries layers l-1 .. l+2: one back so consecutive inputs share most of their
# content, two ahead because prediction runs routers l+1 and l+2 on it.
BACK, AHEAD = 1, 2
# Routers l .. l+2 read x_l, which holds layers l-1 .. l+2: a layer's directions must be
# invisible to routers up to 3 layers away for each router to see only its own layer.
LOOK = BACK + AHEAD
# Weight DECAY**|d| of layer l+d in x_l; only the inputs' similarity depends on it, not routing.
DECAY = 0.7
# Streams of the seeded generators: each (seed, stream, ...) key is an independent sequence.
_POP, _TOPIC, _STATE, _NOISE = range(4)


@dataclass(frozen=True)
class DriverKnobs:
    """Shape of the synthetic routing; defaults are calibrated (module docstring).

    Strengths are in logit units before `logit_scale`.
    """

    # Chance an active topic is still active at the next token: how long a token's context
    # keeps choosing the same experts (token-to-token reuse).
    persistence: float = 0.7
    # Topics active at once: more of them spread a token's choice over more experts.
    n_active: int = 3
    # Topics to draw from, and the Zipf exponent of how often each is drawn: a few topics
    # recurring is what keeps a cache useful across switches.
    n_topics: int = 64
    topic_skew: float = 1.35
    # Std of the active topics' combined logits.
    topic_scale: float = 2.2
    # Std of each token's own logits (fresh every token, written from the embedding on, so
    # visible to prediction): makes consecutive tokens differ without hurting prediction.
    token_scale: float = 2.0
    # Zipf exponent of static expert popularity: logit bonus -popularity * ln(1 + rank).
    popularity: float = 1.8
    # Std of each of the two per-(token, layer) logit pieces written by layers m-1 and m: what
    # prediction from layer l cannot see. 0 = perfect prediction.
    innovation: float = 0.44
    # Multiplies every logit: leaves which experts win unchanged and sets how peaked the router
    # weights are (the real trace's renormalised top-6 weights average 0.27 for the first).
    logit_scale: float = 0.24

    def __post_init__(self) -> None:
        if not 0.0 <= self.persistence <= 1.0:
            raise ConfigError(f"DriverKnobs.persistence must be in 0..1, got {self.persistence}")
        if not self.logit_scale > 0:
            raise ConfigError(f"DriverKnobs.logit_scale must be > 0, got {self.logit_scale}")
        if not 1 <= self.n_active <= self.n_topics:
            raise ConfigError(
                f"DriverKnobs.n_active must be in 1..n_topics ({self.n_topics}), "
                f"got {self.n_active}"
            )
        for name in ("topic_skew", "topic_scale", "token_scale", "popularity", "innovation"):
            if getattr(self, name) < 0:
                raise ConfigError(f"DriverKnobs.{name} must be >= 0, got {getattr(self, name)}")


def route_ids(x: npt.NDArray[np.floating], router: npt.NDArray[np.floating], top_k: int) -> I32:
    """Top-k experts of softmax(x @ router.T), best first, ties to the lower index: [T, k]."""
    logits = np.asarray(x, np.float32) @ np.asarray(router, np.float32).T
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    ids: I32 = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k].astype(np.int32)
    return ids


class Tokens:
    """A run of consecutive tokens; layer inputs are computed on demand, one layer at a time."""

    def __init__(self, driver: SyntheticDriver, active: I64, batch: int) -> None:
        self._driver = driver
        self._active = active  # [n, n_active] topic ids per token
        self._batch = batch  # which call made this run: seeds its innovation noise
        self.n = int(active.shape[0])

    def layer_input(self, layer: int) -> F32:
        """float32 [n, hidden] input of MoE layer `layer` for these tokens."""
        return self._driver._layer_input(self._active, self._batch, layer)


class SyntheticDriver:
    """Deterministic stream of MoE layer inputs for one growing sequence.

    `prompt(n)` and `decode()` continue the same sequence, so context carries from a prompt into
    its decode steps and across turns. Same seed and same call sequence, same inputs.
    """

    def __init__(
        self,
        geometry: Geometry,
        routers: RouterSource,
        seed: int = 0,
        knobs: DriverKnobs | None = None,
    ) -> None:
        self.geometry = geometry
        self.knobs = knobs or DriverKnobs()
        self.seed = seed
        self._router_source = routers
        self._routers: dict[int, F32] = {}
        self._duals: dict[int, F32] = {}
        self._layer_params: dict[int, tuple[F32, F32]] = {}
        self._rng = np.random.default_rng((seed, _STATE))
        k = self.knobs
        topic_p = (1.0 + np.arange(k.n_topics)) ** -k.topic_skew
        self._topic_p = topic_p / topic_p.sum()
        self._active = self._draw_topics(k.n_active)
        self._batch = 0

    # -- sequence ------------------------------------------------------------------------------

    def prompt(self, n_tokens: int) -> Tokens:
        """The next `n_tokens` tokens of the sequence (a prompt or a chunk of one)."""
        if n_tokens < 1:
            raise ConfigError(f"prompt needs n_tokens >= 1, got {n_tokens}")
        k = self.knobs
        active = np.empty((n_tokens, k.n_active), np.int64)
        for t in range(n_tokens):
            switch = self._rng.random(k.n_active) >= k.persistence
            if switch.any():
                self._active = self._active.copy()
                self._active[switch] = self._draw_topics(int(switch.sum()))
            active[t] = self._active
        tokens = Tokens(self, active, self._batch)
        self._batch += 1
        return tokens

    def decode(self) -> Tokens:
        """The next single token of the sequence."""
        return self.prompt(1)

    def _draw_topics(self, n: int) -> I64:
        out: I64 = self._rng.choice(self.knobs.n_topics, n, p=self._topic_p)
        return out

    # -- per-layer constants -------------------------------------------------------------------

    def router(self, layer: int) -> F32:
        """Router `layer` as float32 [n_experts, hidden] (fetched once)."""
        if layer not in self._routers:
            src = self._router_source
            r = np.ascontiguousarray(src(layer) if callable(src) else src[layer], np.float32)
            g = self.geometry
            if r.shape != (g.n_experts, g.hidden):
                raise ConfigError(
                    f"router {layer} has shape {r.shape}, expected {(g.n_experts, g.hidden)}"
                )
            self._routers[layer] = r
        return self._routers[layer]

    def _dual(self, layer: int) -> F32:
        """[n_experts, hidden]: router(layer) @ dual.T ~= I, nearby routers @ dual.T ~= 0."""
        if layer not in self._duals:
            g = self.geometry
            # Keep the stack no taller than hidden so the constraints stay satisfiable; with
            # fewer neighbours the far ones see some crosstalk, which only adds noise.
            pairs = min(LOOK, max(0, (g.hidden // g.n_experts - 1) // 2))
            near = [
                j
                for dist in range(1, pairs + 1)
                for j in (layer - dist, layer + dist)
                if 0 <= j < g.n_layers
            ]
            stack = np.concatenate([self.router(j) for j in (layer, *near)])
            gram = stack @ stack.T
            # Ridge keeps correlated or rank-deficient routers (real ones) from blowing the
            # directions up; random routers are well conditioned and barely affected. With it
            # a float32 solve is as good as float64 here (~1e-7 apart) and cheaper.
            n = len(gram)
            gram += np.float32(1e-3 * np.trace(gram) / n) * np.eye(n, dtype=np.float32)
            rhs = np.eye(n, g.n_experts, dtype=np.float32)
            self._duals[layer] = np.linalg.solve(gram, rhs).T @ stack
        return self._duals[layer]

    def _params(self, layer: int) -> tuple[F32, F32]:
        """(popularity logits [E], topic preferences [n_topics, E]) of one layer."""
        if layer not in self._layer_params:
            k, e = self.knobs, self.geometry.n_experts
            rank = np.random.default_rng((self.seed, _POP, layer)).permutation(e)
            pop = (-k.popularity * np.log1p(rank)).astype(np.float32)
            rng = np.random.default_rng((self.seed, _TOPIC, layer))
            # Scaled so the sum over the active topics has std topic_scale whatever n_active.
            scale = k.topic_scale / np.sqrt(k.n_active)
            topics = (rng.standard_normal((k.n_topics, e)) * scale).astype(np.float32)
            self._layer_params[layer] = (pop, topics)
        return self._layer_params[layer]

    # -- layer inputs --------------------------------------------------------------------------

    def _logits(self, active: I64, batch: int, layer: int, ahead: int) -> F32:
        """z_layer as written by `ahead` layers before `layer` (0 = all of it)."""
        pop, topics = self._params(layer)
        z: F32 = pop + topics[active].sum(axis=1)
        rng = np.random.default_rng((self.seed, _NOISE, batch, layer))
        # All pieces are drawn whatever `ahead` is, so a piece is the same number in every
        # layer input that contains it.
        noise = rng.standard_normal((3, *z.shape), np.float32)
        z += noise[2] * np.float32(self.knobs.token_scale)
        # Innovation piece i is written by layer `layer - i`.
        for i in range(ahead, 2):
            z += noise[i] * np.float32(self.knobs.innovation)
        # Softmax ignores a shift; dropping the mean keeps |x| small, and with it the crosstalk
        # that far routers see.
        z -= z.mean(axis=1, keepdims=True)
        return z

    def _layer_input(self, active: I64, batch: int, layer: int) -> F32:
        g = self.geometry
        if not 0 <= layer < g.n_layers:
            raise ConfigError(f"layer {layer} out of range 0..{g.n_layers - 1}")
        x = np.zeros((active.shape[0], g.hidden), np.float32)
        for d in range(-BACK, AHEAD + 1):
            m = layer + d
            if 0 <= m < g.n_layers:
                z = self._logits(active, batch, m, max(d, 0))
                x += np.float32(DECAY ** abs(d)) * (z @ self._dual(m))
        x *= np.float32(self.knobs.logit_scale)
        return x
