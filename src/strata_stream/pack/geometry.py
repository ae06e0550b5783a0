"""The shape of a mixture-of-experts model as far as the pack is concerned."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from strata_stream.errors import ConfigError

# Qwen3-MoE / OLMoE softmax over all experts then pick the top k; Mixtral picks the top k logits
# then softmaxes over just those; "external": the pack holds no routers because the model routes
# itself (an mlx-lm model's own gate, any family) and hands the engine ids and weights
# (Window.moe_routed). The header stores the index into this tuple.
ROUTINGS = ("softmax_topk", "topk_softmax", "external")
# Expert activations (docs/pack-format.md, "Activations"): "swiglu" silu(gate) * up;
# "swiglu_oai" (gpt-oss) (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with
# g = min(gate, limit). Format version 4 only: "swiglu_clamp" silu(min(gate, limit)) *
# clip(up, -limit, limit); "geglu_tanh" gelu_tanh(gate) * up; "swiglu_softcap"
# cap(gate, alpha) * sigmoid(gate) * cap(up, limit) with cap(x, c) = tanh(x / c) * c; "relu2"
# relu(up)^2, the activation of gateless experts (no gate matrix). The header stores the index.
ACTIVATIONS = ("swiglu", "swiglu_oai", "swiglu_clamp", "geglu_tanh", "swiglu_softcap", "relu2")
# Which of act_alpha and act_limit each activation uses (the others are stored as 0).
ACTIVATION_CONSTANTS = {
    "swiglu": (False, False),
    "swiglu_oai": (True, True),
    "swiglu_clamp": (False, True),
    "geglu_tanh": (False, False),
    "swiglu_softcap": (True, True),
    "relu2": (False, False),
}
# The activations of format versions 2 and 3; the others need version 4.
BASE_ACTIVATIONS = ("swiglu", "swiglu_oai")

# The header stores every dimension as u32.
_U32_MAX = 2**32 - 1

_INT_FIELDS = ("n_layers", "n_experts", "top_k", "hidden", "moe_intermediate")


@dataclass(frozen=True)
class Geometry:
    """Layers, experts and widths of an MoE model, plus its routing rule.

    Expert matrices are gate and up ``[moe_intermediate, hidden]`` and down
    ``[hidden, moe_intermediate]``; routers are ``[n_experts, hidden]``.
    """

    n_layers: int
    n_experts: int
    top_k: int
    hidden: int
    moe_intermediate: int
    routing: str = "softmax_topk"
    norm_topk_prob: bool = True
    activation: str = "swiglu"
    # The activation's constants (ACTIVATION_CONSTANTS; 0 where it has none); stored as float32
    # in the header, so normalised to it here.
    act_alpha: float = 1.702
    act_limit: float = 7.0
    # False: the experts have no gate matrix (up, down; activation relu2), format version 4.
    gated: bool = True

    def __post_init__(self) -> None:
        for name in _INT_FIELDS:
            value = getattr(self, name)
            # bool is an int subclass; True layers is a bug, not a 1.
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ConfigError(
                    f"Geometry.{name} must be an int, got {type(value).__name__} {value!r}"
                )
            if not 1 <= value <= _U32_MAX:
                raise ConfigError(f"Geometry.{name} must be in 1..{_U32_MAX}, got {value}")
            # Normalise numpy ints so equality, hashing and JSON behave like plain ints.
            object.__setattr__(self, name, int(value))
        if self.top_k > self.n_experts:
            raise ConfigError(
                f"Geometry.top_k {self.top_k} exceeds Geometry.n_experts {self.n_experts}"
            )
        if self.routing not in ROUTINGS:
            raise ConfigError(
                f"Geometry.routing must be one of {', '.join(ROUTINGS)}, got {self.routing!r}"
            )
        if not isinstance(self.norm_topk_prob, (bool, np.bool_)):
            raise ConfigError(
                f"Geometry.norm_topk_prob must be a bool, got "
                f"{type(self.norm_topk_prob).__name__} {self.norm_topk_prob!r}"
            )
        object.__setattr__(self, "norm_topk_prob", bool(self.norm_topk_prob))
        if self.activation not in ACTIVATIONS:
            raise ConfigError(
                f"Geometry.activation must be one of {', '.join(ACTIVATIONS)}, "
                f"got {self.activation!r}"
            )
        for name, used in zip(
            ("act_alpha", "act_limit"), ACTIVATION_CONSTANTS[self.activation], strict=True
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)):
                raise ConfigError(f"Geometry.{name} must be a number, got {value!r}")
            if not used:
                value = 0.0  # unused: one canonical header for every pack of the activation
            elif not (np.isfinite(value) and value > 0):
                raise ConfigError(f"Geometry.{name} must be finite and positive, got {value}")
            object.__setattr__(self, name, float(np.float32(value)))
        if not isinstance(self.gated, (bool, np.bool_)):
            raise ConfigError(f"Geometry.gated must be a bool, got {self.gated!r}")
        object.__setattr__(self, "gated", bool(self.gated))
        if (self.activation == "relu2") == self.gated:
            raise ConfigError(
                "Geometry.activation relu2 is for gateless experts (gated=False)"
                if self.gated
                else f"gateless experts (gated=False) compute relu2, not {self.activation}"
            )

    @property
    def has_routers(self) -> bool:
        """Whether a pack of this geometry stores routers (not with "external" routing)."""
        return self.routing != "external"

    @property
    def extended(self) -> bool:
        """Whether a pack of this geometry needs format version 4 (an activation of version 4,
        or gateless experts)."""
        return self.activation not in BASE_ACTIVATIONS or not self.gated

    @property
    def n_records(self) -> int:
        """Number of expert records in a pack: one per (layer, expert)."""
        return self.n_layers * self.n_experts

    def matrix_shapes(self) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
        """Logical (rows, cols) of gate, up and down."""
        gate = (self.moe_intermediate, self.hidden)
        return gate, gate, (self.hidden, self.moe_intermediate)

    def to_dict(self) -> dict[str, Any]:
        # "gated" only where false: a version 2 or 3 pack's metadata keeps its bytes.
        extra: dict[str, Any] = {} if self.gated else {"gated": False}
        return {
            "n_layers": self.n_layers,
            "n_experts": self.n_experts,
            "top_k": self.top_k,
            "hidden": self.hidden,
            "moe_intermediate": self.moe_intermediate,
            "routing": self.routing,
            "norm_topk_prob": self.norm_topk_prob,
            "activation": self.activation,
            "act_alpha": self.act_alpha,
            "act_limit": self.act_limit,
            **extra,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Geometry:
        missing = [k for k in (*_INT_FIELDS, "routing", "norm_topk_prob") if k not in d]
        if missing:
            raise ConfigError(f"Geometry is missing field(s): {', '.join(missing)}")
        return cls(
            n_layers=d["n_layers"],
            n_experts=d["n_experts"],
            top_k=d["top_k"],
            hidden=d["hidden"],
            moe_intermediate=d["moe_intermediate"],
            routing=d["routing"],
            norm_topk_prob=d["norm_topk_prob"],
            activation=d.get("activation", "swiglu"),
            act_alpha=d.get("act_alpha", 1.702),
            act_limit=d.get("act_limit", 7.0),
            gated=d.get("gated", True),
        )
