"""Which transformers MoE blocks stream: decided by the experts interface, whatever the family.

In transformers 5 every MoE family's routed experts are one module decorated with
``use_experts_implementation``: the block routes with its own router and then calls
``self.experts(hidden_states, top_k_index, top_k_weights)``. That call is the seam. Only the
experts module is replaced (loader.py); routing, mixture weights, shared experts and the rest of
the block stay the model's own code. Nothing here names a class: a block is taken on by what
its experts module is.

- The experts module is recognised by the decorator's marker (the flags it sets on every
  instance: ``has_gate``, ``is_transposed``, ``is_concatenated``, ...; the class's
  ``_apply_gate``) and a forward that takes ``(hidden_states, top_k_index, top_k_weights)``.
- Its geometry comes from its parameters: ``gate_up_proj`` is ``[E, 2I, H]`` or, transposed,
  ``[E, H, 2I]`` (told apart by which axis is the hidden size), ``down_proj`` the other way
  round, with ``gate_up_proj_bias`` / ``down_proj_bias`` where the experts have biases.
- Its activation is what its own ``_apply_gate`` (the gate function every experts
  implementation of transformers applies to the fused gate-up output) computes on a probe,
  compared with what the pack computes (`check_activation`): each activation the pack format
  knows (SwiGLU with silu, gpt-oss's clamped SwiGLU, SwiGLU between clamps, GELU-tanh GLU,
  softcapped SwiGLU), on the gate/up split the converter wrote. Gateless experts
  (``has_gate`` False: ``up_proj`` and ``down_proj``) are compared the same way, their
  ``act_fn`` on a probe against the pack's relu2. Anything else is refused by name, never
  computed with the wrong function.
- Modules with weights besides the projections are taken on where the interface accounts for
  them (`unaccounted`, the one rule): the norm the decorator's ``has_post_expert_norm`` says
  every backend applies to each route's output before the mixture weights (muse_spark's
  ``post_expert_norm``, kept resident and applied by the engine to the streamed per-route
  outputs), or modules that a forward of the experts class's own applies around the
  interface class's dispatch (ergo's per-expert norm: the dispatch is streamed and that
  forward runs unchanged). Any other weighted module, a forward of its own that reads the
  projections itself, or experts without fused projections are refused with one line naming
  the model type and the reason.

The router predicts: layer l+1's router on layer l's input (engine.py). It is found by
structure too (`find_router`): the block's child module whose forward returns the expert ids,
an integer ``[T, top_k]`` tensor among its outputs. A block whose router returns no ids (its
block computes them from logits) predicts nothing, and the engine falls back to the expert
profile for that layer (``prediction`` in the engine's stats).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from strata_stream.convert.experts_interface import (
    declared_concatenated as declared_concatenated,
)
from strata_stream.convert.experts_interface import find_blocks as find_blocks
from strata_stream.convert.experts_interface import is_experts_module as is_experts_module
from strata_stream.errors import ConfigError

# Probe of the gate function: [rows, 2I] values spanning both signs and beyond gpt-oss's clamp.
_PROBE_ROWS = 8
_PROBE_SPAN = 12.0


@dataclass(frozen=True)
class Family:
    """One sparse block's experts, as the experts module's structure describes them."""

    model_type: str
    experts_class: str  # for messages only
    act_fn: str  # the experts' act_fn class (config.hidden_act), for messages only
    n_experts: int
    moe_intermediate: int
    hidden: int
    transposed: bool  # gate_up_proj is [E, H, 2I]
    has_bias: bool
    # The experts' own gate function on the probe (`gate_probe`): compared with the pack's
    # activation once the pack is open (check_activation).
    gate_out: Any
    concatenated: bool  # the decorator's marker: gate then up (True) or interleaved columns
    gated: bool = True  # False: up_proj and down_proj only; gate_out is act_fn on [rows, I]
    # The decorator's has_post_expert_norm: every backend applies the module's post_expert_norm
    # to each route's down-projection output before the mixture weights and the sum.
    post_norm: bool = False
    # The experts class has a forward of its own around the interface class's dispatch (ergo):
    # only the dispatch is streamed, and that forward runs unchanged around it.
    own_forward: bool = False


def _param(module: Any, name: str) -> Any:
    import torch

    p = getattr(module, name, None)
    return p if isinstance(p, torch.Tensor) else None


def family_of(experts: Any, model_type: str, hidden: int | None = None) -> Family:
    """The Family of an experts-interface module; ConfigError (one line naming the model type
    and the reason) where the pack cannot hold its experts."""
    cls = type(experts).__name__
    where = f"{model_type}: experts module {cls}"
    why = unaccounted(experts)
    if why:
        raise ConfigError(f"{where} {why}; the pack's experts end at down_proj")
    post_norm = bool(getattr(experts, "has_post_expert_norm", False))
    own_forward = bool(own_forwards(experts))
    if not experts.has_gate:
        family = _gateless_family(experts, model_type, where, hidden)
        return replace(family, post_norm=post_norm, own_forward=own_forward)
    if _param(experts, "gate_up_proj") is None:
        act = type(getattr(experts, "act_fn", None)).__name__
        raise ConfigError(
            f"{where} has no gate_up_proj (activation {act}); the pack holds experts as fused "
            "gate_up_proj and down_proj, or up_proj and down_proj without a gate"
        )
    gate_up = _param(experts, "gate_up_proj")
    down = _param(experts, "down_proj")
    if down is None or gate_up.ndim != 3 or down.ndim != 3:
        raise ConfigError(
            f"{where}: gate_up_proj {list(gate_up.shape)} and down_proj "
            f"{None if down is None else list(down.shape)} are not fused [E, rows, cols] tensors"
        )
    e, a, b = (int(d) for d in gate_up.shape)
    _, c, d = (int(v) for v in down.shape)
    config = getattr(experts, "config", None)
    h = hidden if hidden is not None else int(getattr(config, "hidden_size", 0) or 0)
    rows = b == h and c == h and a == 2 * d  # [E, 2I, H] with [E, H, I]
    cols = a == h and d == h and b == 2 * c  # [E, H, 2I] with [E, I, H]
    if not (rows or cols):
        # Experts of their own width (muse_spark's moe_hidden_size, between the block's own
        # projections): the shapes alone decide, since both orientations cannot fit one pair.
        rows, cols = b == c and a == 2 * d, a == d and b == 2 * c
        h = b if rows else a if cols else h
    if not (rows or cols):
        raise ConfigError(
            f"{where}: gate_up_proj [{e}, {a}, {b}] and down_proj [{e}, {c}, {d}] fit neither "
            f"[E, 2I, {h}] / [E, {h}, I] nor [E, {h}, 2I] / [E, I, {h}]"
        )
    inter = d if rows else c
    has_bias = _param(experts, "gate_up_proj_bias") is not None
    return Family(
        model_type=model_type,
        experts_class=cls,
        act_fn=type(experts.act_fn).__name__ if hasattr(experts, "act_fn") else "none",
        n_experts=e,
        moe_intermediate=inter,
        hidden=h,
        transposed=cols,
        has_bias=has_bias,
        gate_out=_gate_out(experts, inter, where),
        concatenated=bool(experts.is_concatenated),
        post_norm=post_norm,
        own_forward=own_forward,
    )


# The experts interface's weights, which the pack holds (gated or not, with or without biases).
PROJECTIONS = (
    "gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias", "down_proj_bias",
)  # fmt: skip
# The module the decorator's has_post_expert_norm makes every backend apply to each route.
POST_NORM = "post_expert_norm"


def interface_class(experts: Any) -> type[Any] | None:
    """The experts-interface class in the module's MRO: the class use_experts_implementation
    decorated, whose __init__ and forward are the decorator's (each wrapping the class's own,
    so each carries ``__wrapped__``). None where there is none."""
    for cls in type(experts).__mro__:
        init, forward = vars(cls).get("__init__"), vars(cls).get("forward")
        if hasattr(init, "__wrapped__") and hasattr(forward, "__wrapped__"):
            return cls
    return None


def own_forwards(experts: Any) -> list[Any]:
    """The forwards the experts class defines in front of the interface class's dispatch
    (ergo's ErgoExperts.forward around its decorated ErgoExpertProjections): they run
    unchanged when the dispatch is streamed. [] where the module's forward is the dispatch."""
    iface = interface_class(experts)
    if iface is None:
        return []
    mro = type(experts).__mro__
    front = mro[: mro.index(iface)]
    return [vars(c)["forward"] for c in front if "forward" in vars(c)]


def unaccounted(experts: Any) -> str:
    """Why the pack and the interface cannot serve this experts module, "" when they can: the
    one rule for its weights besides the projections. A weighted child module is accounted for
    when the interface applies it (``post_expert_norm`` under the decorator's
    has_post_expert_norm: every backend applies it to each route's output before the mixture
    weights) or when a forward of the class's own, in front of the interface class's dispatch,
    applies it (that forward runs unchanged around the streamed dispatch). Such a forward must
    leave the projections to the dispatch: the streamed module holds none."""
    if interface_class(experts) is None:
        return "has no class decorated by use_experts_implementation in its MRO"
    names: set[str] = set()
    for forward in own_forwards(experts):
        code = getattr(inspect.unwrap(forward), "__code__", None)
        names.update(code.co_names if code is not None else ())
    reads = sorted(names.intersection(PROJECTIONS))
    if reads:
        return (
            f"has a forward of its own that reads the projections itself ({', '.join(reads)}) "
            "instead of calling the experts interface's dispatch"
        )
    post_norm = bool(getattr(experts, "has_post_expert_norm", False))
    if post_norm and not isinstance(getattr(experts, POST_NORM, None), _module_type()):
        return f"says every backend applies {POST_NORM} (has_post_expert_norm), but has none"
    extra = [
        f"{name}: {type(child).__name__}"
        for name, child in experts.named_children()
        if any(True for _ in child.parameters())
        and not (post_norm and name == POST_NORM)
        and name not in names
    ]
    if extra:
        return (
            f"holds modules with weights that neither the experts interface nor a forward of "
            f"its own around the interface applies ({', '.join(extra)})"
        )
    return ""


def _module_type() -> type[Any]:
    import torch

    return torch.nn.Module


def _gateless_family(experts: Any, model_type: str, where: str, hidden: int | None) -> Family:
    """The Family of experts without a gate (``up_proj`` and ``down_proj``, nemotron_h):
    up [E, I, H] with down [E, H, I], or (transposed) up [E, H, I] with down [E, I, H]."""
    up, down = _param(experts, "up_proj"), _param(experts, "down_proj")
    act = type(getattr(experts, "act_fn", None)).__name__
    if up is None or down is None or up.ndim != 3 or down.ndim != 3:
        raise ConfigError(
            f"{where} has no gate projection and no fused up_proj/down_proj [E, rows, cols] "
            f"(activation {act})"
        )
    e, a, b = (int(d) for d in up.shape)
    _, c, d = (int(v) for v in down.shape)
    config = getattr(experts, "config", None)
    h = hidden if hidden is not None else int(getattr(config, "hidden_size", 0) or 0)
    rows = b == h and c == h and a == d  # [E, I, H] with [E, H, I]
    cols = a == h and d == h and b == c  # [E, H, I] with [E, I, H]
    if rows and cols:
        rows, cols = not experts.is_transposed, bool(experts.is_transposed)
    if not (rows or cols):
        raise ConfigError(
            f"{where}: up_proj [{e}, {a}, {b}] and down_proj [{e}, {c}, {d}] fit neither "
            f"[E, I, {h}] / [E, {h}, I] nor [E, {h}, I] / [E, I, {h}]"
        )
    inter = a if rows else b
    return Family(
        model_type=model_type,
        experts_class=type(experts).__name__,
        act_fn=act,
        n_experts=e,
        moe_intermediate=inter,
        hidden=h,
        transposed=cols,
        has_bias=_param(experts, "up_proj_bias") is not None,
        gate_out=_act_out(experts, inter, where),
        concatenated=bool(experts.is_concatenated),
        gated=False,
    )


def _act_out(experts: Any, inter: int, where: str) -> Any:
    """A gateless experts module's act_fn on the first half of the probe ([rows, I])."""
    import torch

    act_fn = getattr(experts, "act_fn", None)
    if not callable(act_fn):
        raise ConfigError(f"{where} has no gate projection and no act_fn")
    try:
        with torch.no_grad():
            out = act_fn(gate_probe(inter)[:, :inter])
    except Exception as e:  # noqa: BLE001 - any failure means: not an activation we can compare
        raise ConfigError(f"{where}: its act_fn failed on a probe ({type(e).__name__}: {e})"
                          ) from None  # fmt: skip
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (_PROBE_ROWS, inter):
        raise ConfigError(f"{where}: its act_fn does not map [T, I] to [T, I]")
    return out.detach().to(torch.float32)


def gate_probe(inter: int) -> Any:
    """The fixed [rows, 2I] float32 input the gate functions are compared on."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(0)
    # dtype and device explicit: from_pretrained builds the model under its own defaults
    probe = torch.rand(_PROBE_ROWS, 2 * inter, generator=gen, device="cpu", dtype=torch.float32)
    return (probe * 2 - 1) * _PROBE_SPAN


def _gate_out(experts: Any, inter: int, where: str) -> Any:
    import torch

    try:
        with torch.no_grad():
            out = type(experts)._apply_gate(experts, gate_probe(inter))
    except Exception as e:  # noqa: BLE001 - any failure means: not a gate we can compare
        raise ConfigError(f"{where}: its gate function failed on a probe ({type(e).__name__}: "
                          f"{e})") from None  # fmt: skip
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (_PROBE_ROWS, inter):
        raise ConfigError(f"{where}: its gate function does not map [T, 2I] to [T, I]")
    return out.detach().to(torch.float32)


def pack_gate(activation: str, alpha: float, limit: float, interleaved: bool) -> Callable[..., Any]:
    """What the pack computes from a [T, 2I] gate-up output: its activation on the gate and up
    halves as the converter split them (interleaved columns, or gate then up)."""
    import torch

    def apply(h: Any) -> Any:
        gate, up = (h[..., ::2], h[..., 1::2]) if interleaved else h.chunk(2, dim=-1)
        if activation == "swiglu_oai":
            gate = gate.clamp(max=limit)
            up = up.clamp(min=-limit, max=limit)
            return (up + 1) * (gate * torch.sigmoid(gate * alpha))
        if activation == "swiglu_clamp":
            gate = gate.clamp(max=limit)
            up = up.clamp(min=-limit, max=limit)
        if activation == "geglu_tanh":
            return torch.nn.functional.gelu(gate, approximate="tanh") * up
        if activation == "swiglu_softcap":
            capped = torch.tanh(gate / alpha) * alpha
            return capped * torch.sigmoid(gate) * (torch.tanh(up / limit) * limit)
        return torch.nn.functional.silu(gate) * up

    return apply


def check_activation(family: Family, activation: str, alpha: float, limit: float,
                     layout: str | None) -> None:  # fmt: skip
    """ConfigError unless the pack's activation, on the converter's gate/up split (`layout`,
    the pack's model.layout), is the experts' own gate function."""
    import torch

    if not family.gated:
        # The pack's gateless experts compute relu2 of up, nothing else.
        probe = gate_probe(family.moe_intermediate)[:, : family.moe_intermediate]
        got = torch.relu(probe).square()
        if activation == "relu2" and torch.allclose(got, family.gate_out, rtol=1e-5, atol=1e-5):
            return
        raise ConfigError(
            f"{family.model_type}: experts module {family.experts_class}'s activation (act_fn "
            f"{family.act_fn}) is not the pack's {activation} (gateless experts compute relu2)"
        )
    if layout == "fused_columns":
        interleaved = True
    elif layout in ("fused_rows", "fused_columns_halves"):
        interleaved = False
    else:  # per-expert or stacked tensors: transformers fuses them in its own order
        interleaved = not family.concatenated
    want = family.gate_out
    got = pack_gate(activation, alpha, limit, interleaved)(gate_probe(family.moe_intermediate))
    if torch.allclose(got, want, rtol=1e-5, atol=1e-5, equal_nan=True):
        return
    split = "interleaved" if interleaved else "concatenated"
    raise ConfigError(
        f"{family.model_type}: experts module {family.experts_class}'s gate function (act_fn "
        f"{family.act_fn}) is not the pack's {activation} on {split} gate/up halves (the pack "
        "computes swiglu, swiglu_oai, swiglu_clamp, geglu_tanh and swiglu_softcap)"
    )


@dataclass(frozen=True)
class Router:
    """A block's router as the block calls it: `module.forward(x)` whose output `index` is the
    [T, top_k] expert ids."""

    module: Any
    index: int | None  # None: the output is the ids tensor itself


def find_router(block: Any, experts_attr: str, top_k: int, n_experts: int,
                hidden: int) -> Router | None:  # fmt: skip
    """The block's child module whose forward, on a probe [T, hidden] in the model's dtype,
    returns integer [T, top_k] ids within [0, n_experts); None where no child does."""
    import torch

    rows = 3
    for name, child in block.named_children():
        if name == experts_attr:
            continue
        params = [p for p in child.parameters() if p.is_floating_point()]
        if not params or params[0].is_meta:
            continue
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(rows, hidden, generator=gen).to(params[0].dtype).to(params[0].device)
        try:
            with torch.no_grad():
                out = type(child).forward(child, x)
        except Exception:  # noqa: BLE001 - a module that is not a router
            continue
        outs = list(out) if isinstance(out, tuple | list) else [out]
        for i, t in enumerate(outs):
            if (
                isinstance(t, torch.Tensor)
                and not t.is_floating_point()
                and t.dtype != torch.bool
                and tuple(t.shape) == (rows, top_k)
                and int(t.min()) >= 0
                and int(t.max()) < n_experts
            ):
                return Router(child, i if isinstance(out, tuple | list) else None)
    return None


def route_ids(router: Router, x: Any) -> Any:
    """The expert ids the router picks for x [T, H] ([T, k]). Called through forward, not
    __call__: transformers records router outputs with module hooks (output_router_logits),
    and a prediction is not one of the model's routings."""
    out = type(router.module).forward(router.module, x)
    return out if router.index is None else out[router.index]


def post_norm_of(module: Any, family: Family) -> Any | None:
    """The norm the engine applies to each streamed route's output (the experts module's own
    post_expert_norm, where the interface's has_post_expert_norm says so); None otherwise."""
    import torch

    if not family.post_norm:
        return None
    norm = getattr(module, POST_NORM, None)
    return norm if isinstance(norm, torch.nn.Module) else None
