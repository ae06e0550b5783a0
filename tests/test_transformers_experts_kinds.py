"""strata_stream.transformers.families on experts modules of the kinds pack format version 4
adds: gateless experts (up_proj, an activation, down_proj) are taken on by structure and their
activation checked against the pack's relu2 on a probe; an experts module whose own forward
applies a norm around the interface's dispatch is taken on (that forward runs unchanged around
the streamed dispatch), as is the interface's own post_expert_norm, and weights neither of them
applies are refused by name; the gated kinds' gate functions are told apart (the pack's
activation must be the module's own).
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


def _normed(body: str) -> Any:
    """A gateless experts class with a norm module and a forward of its own in front of the
    decorated class's dispatch: `body` "calls" (super().forward, then its norm), "reads" (its
    own projections instead) or "ignores" (super().forward alone: the norm applied by nobody)."""
    base = type(_gateless("relu2"))

    class NormedExperts(base):  # type: ignore[misc, valid-type]
        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.post_expert_norm = torch.nn.LayerNorm(H)

        if body == "calls":

            def forward(self, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
                out = super().forward(hidden_states, top_k_index, top_k_weights)
                return self.post_expert_norm(out)

        elif body == "reads":

            def forward(self, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
                return self.post_expert_norm(hidden_states @ self.up_proj[0] @ self.down_proj[0])

        else:

            def forward(self, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
                return super().forward(hidden_states, top_k_index, top_k_weights)

    return NormedExperts(_Config())


def test_a_forward_of_its_own_that_applies_a_norm_around_the_dispatch_is_taken_on() -> None:
    # ergo's shape: the decorated class's dispatch is streamed, the class's own forward (and
    # its norm) runs unchanged around it.
    family = family_of(_normed("calls"), "fake")
    assert family.own_forward and not family.post_norm and not family.gated


def test_weights_the_interface_does_not_account_for_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"fake: experts module NormedExperts has a forward of "
                                          r"its own that reads the projections itself "
                                          r"\(down_proj, up_proj\)"):  # fmt: skip
        family_of(_normed("reads"), "fake")
    with pytest.raises(ConfigError, match=r"fake: experts module NormedExperts holds modules with "
                                          r"weights that neither the experts interface nor a "
                                          r"forward of its own around the interface applies "
                                          r"\(post_expert_norm: LayerNorm\)"):  # fmt: skip
        family_of(_normed("ignores"), "fake")


def test_the_interfaces_post_expert_norm_is_taken_on_and_a_missing_one_refused() -> None:
    @use_experts_implementation(has_post_expert_norm=True)
    class Experts(torch.nn.Module):
        def __init__(self, config: Any, norm: bool = True) -> None:
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.zeros(E, 2 * INTER, H))
            self.down_proj = torch.nn.Parameter(torch.zeros(E, H, INTER))
            self.act_fn = ACT2FN["silu"]
            if norm:
                self.post_expert_norm = torch.nn.LayerNorm(H)

        def forward(self, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
            return hidden_states

    family = family_of(Experts(_Config()), "fake")
    assert family.post_norm and not family.own_forward
    with pytest.raises(ConfigError, match=r"fake: experts module Experts says every backend "
                                          r"applies post_expert_norm \(has_post_expert_norm\), "
                                          r"but has none"):  # fmt: skip
        family_of(Experts(_Config(), norm=False), "fake")


def test_experts_of_their_own_width_take_it_from_their_tensors() -> None:
    # muse_spark's experts work at moe_hidden_size, between the block's own projections: the
    # config's hidden_size is not theirs.
    family = family_of(_gated("silu"), "fake", hidden=4 * H)
    assert (family.hidden, family.moe_intermediate, family.transposed) == (H, INTER, False)
