"""strata_stream.transformers.families on experts modules of the kinds pack format version 4
adds: gateless experts (up_proj, an activation, down_proj) are taken on by structure and their
activation checked against the pack's relu2 on a probe; an experts module whose own forward
applies weighted modules after the projections (a per-expert norm) is refused by name; the
gated kinds' gate functions are told apart (the pack's activation must be the module's own).
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers.activations import ACT2FN  # noqa: E402
from transformers.integrations.moe import use_experts_implementation  # noqa: E402

from strata_stream.errors import ConfigError  # noqa: E402
from strata_stream.transformers.families import check_activation, family_of  # noqa: E402

E, H, INTER = 4, 16, 8


class _Config:
    hidden_size = H
    _experts_implementation = "eager"


def _gateless(act: str, transposed: bool = False) -> Any:
    @use_experts_implementation(has_gate=False, is_transposed=transposed)
    class Experts(torch.nn.Module):
        def __init__(self, config: Any) -> None:
            super().__init__()
            up, down = (
                ((E, H, INTER), (E, INTER, H)) if transposed else ((E, INTER, H), (E, H, INTER))
            )
            self.up_proj = torch.nn.Parameter(torch.zeros(up))
            self.down_proj = torch.nn.Parameter(torch.zeros(down))
            self.act_fn = ACT2FN[act]

        def forward(self, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
            return hidden_states

    return Experts(_Config())


def _gated(act: str) -> Any:
    @use_experts_implementation
    class Experts(torch.nn.Module):
        def __init__(self, config: Any) -> None:
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.zeros(E, 2 * INTER, H))
            self.down_proj = torch.nn.Parameter(torch.zeros(E, H, INTER))
            self.act_fn = ACT2FN[act]

        def forward(self, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
            return hidden_states

    return Experts(_Config())


@pytest.mark.parametrize("transposed", [False, True])
def test_gateless_relu2_experts_are_taken_on(transposed: bool) -> None:
    family = family_of(_gateless("relu2", transposed), "fake")
    assert not family.gated
    assert (family.n_experts, family.moe_intermediate, family.hidden) == (E, INTER, H)
    assert family.transposed == transposed
    check_activation(family, "relu2", 0.0, 0.0, "per_expert")
    with pytest.raises(ConfigError, match="is not the pack's swiglu"):
        check_activation(family, "swiglu", 0.0, 0.0, "per_expert")


def test_gateless_experts_of_another_activation_are_refused_by_name() -> None:
    family = family_of(_gateless("gelu"), "fake")
    with pytest.raises(ConfigError, match=r"fake: experts module Experts's activation \(act_fn "
                                          r"GELUActivation\) is not the pack's relu2"):  # fmt: skip
        check_activation(family, "relu2", 0.0, 0.0, "per_expert")


def test_gated_kinds_are_told_apart() -> None:
    geglu = family_of(_gated("gelu_pytorch_tanh"), "fake")
    check_activation(geglu, "geglu_tanh", 0.0, 0.0, "per_expert")
    with pytest.raises(ConfigError, match="is not the pack's swiglu "):
        check_activation(geglu, "swiglu", 0.0, 0.0, "per_expert")
    silu = family_of(_gated("silu"), "fake")
    check_activation(silu, "swiglu", 0.0, 0.0, "per_expert")
    # the probe reaches beyond the clamp: a clamped SwiGLU is not a plain one
    with pytest.raises(ConfigError, match="is not the pack's swiglu_clamp"):
        check_activation(silu, "swiglu_clamp", 0.0, 3.0, "per_expert")
    with pytest.raises(ConfigError, match="is not the pack's swiglu_softcap"):
        check_activation(silu, "swiglu_softcap", 4.0, 25.0, "per_expert")


def test_a_forward_that_applies_a_norm_after_the_experts_is_refused() -> None:
    base = type(_gateless("relu2"))

    class NormedExperts(base):  # type: ignore[misc, valid-type]
        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.post_expert_norm = torch.nn.LayerNorm(H)

        def forward(self, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
            out = super().forward(hidden_states, top_k_index, top_k_weights)
            return self.post_expert_norm(out)

    with pytest.raises(ConfigError, match=r"applies modules with weights besides the projections "
                                          r"\(post_expert_norm: LayerNorm\)"):  # fmt: skip
        family_of(NormedExperts(_Config()), "fake")
