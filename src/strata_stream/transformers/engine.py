"""The streaming engine under a transformers model: one ExpertStream and Window for all blocks.

Every streamed experts module calls `TorchMoeEngine.run(layer, ...)` in decoder order during a
forward pass; the Window's turn is the pass (it opens at pack layer 0, closes after the last).
A decoder layer may hold several experts modules (ERNIE-4.5-VL's text and vision experts), one
pack layer each, of which a pass runs only those its tokens route to: the engine moves the turn
past the others (`Window.pass_layer`), and predicts a pack layer only from the layers whose
tokens run it next (the same experts set of an earlier decoder layer, `_predicts`).
Only the expert ids and weights (and the predicted ids) cross to the host, as they are (no
kernel casts them): the host widens them to the binding's int32 and float32, which changes no
value.
- CPU: x is read in place from the torch tensor, and the output comes back as a torch tensor
  over the engine's float32 result, cast to x's dtype.
- CUDA: the Window is on the cuda backend; x (float32: a bfloat16 or float16 x is widened in
  torch) is read in place from the torch CUDA tensor and the output is written into a torch
  CUDA tensor by the backend. The routing's tables are copied into pinned host memory on
  torch's stream, and one event after them is waited for (one synchronization of torch's stream
  per layer): when it returns torch's stream has finished x. The call returns once the
  backend's kernels are queued, torch's current stream waiting for them on the device (an
  event the backend records after the layer's last kernel), so torch's later kernels (the cast
  of the output, the next layer) are ordered after the experts' output without a host wait; the
  next layer's routing synchronization then also covers this layer's kernels.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from strata_stream.config import StreamConfig
from strata_stream.errors import ConfigError
from strata_stream.pack.reader import ExpertPack
from strata_stream.stream import ExpertStream
from strata_stream.transformers.families import Family, Router, find_router, post_norm_of, route_ids
from strata_stream.window import Window

_X_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
# The routing as the binding takes it: ids, weights, predicted ids (l+1, l+2) or None.
_HostRouting = tuple[
    npt.NDArray[np.int32],
    npt.NDArray[np.float32],
    npt.NDArray[np.int32] | None,
    npt.NDArray[np.int32] | None,
]


@dataclass
class BlockRef:
    """One sparse block of the model and its place in the pack."""

    layer: int  # pack layer
    decoder_layer: int
    block: Any  # the model's own block (router, shared experts, ...)
    family: Family
    experts_attr: str = "experts"  # the block's attribute the experts module was
    # The block's router, found by structure (families.find_router); None: this layer is
    # predicted from the expert profile instead.
    router: Router | None = None
    # The norm the experts interface applies to each route's output before the mixture weights
    # (the experts module's own post_expert_norm: families.post_norm_of); None: none.
    post_norm: Any = None
    # The experts module's path within its decoder layer (loader.set_path): what tells apart
    # the experts sets of a decoder layer that holds several.
    path: str = ""


class TorchMoeEngine:
    """Owns the stream and the Window; runs one experts call through the handshake."""

    def __init__(
        self,
        pack: ExpertPack,
        config: StreamConfig,
        blocks: list[BlockRef],
        device: torch.device | None = None,
    ) -> None:
        self.config = config
        self.blocks = blocks
        self.top_k = pack.geometry.top_k
        self.hidden = pack.geometry.hidden
        self.device = torch.device("cpu") if device is None else device
        self.on_cuda = self.device.type == "cuda"
        self.stream = ExpertStream(pack.path, config)
        try:
            self.window = Window(self.stream, backend="cuda" if self.on_cuda else "cpu")
        except BaseException:
            self.stream.close()
            raise
        self.routing = _PinnedRouting() if self.on_cuda else None
        # Set while several forward passes run at once (serve/transformers_continuous.py): every
        # experts call goes through it, which joins the passes' calls of one layer into one
        # `run_rows` (one union read) and hands each pass its own rows back.
        self.gather: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None
        self.gather = None
        self.closed = False
        for ref in blocks:
            ref.router = find_router(
                ref.block, ref.experts_attr, self.top_k, pack.geometry.n_experts, self.hidden
            )
            ref.post_norm = post_norm_of(getattr(ref.block, ref.experts_attr), ref.family)
        try:
            self._check_routes(blocks)
        except BaseException:
            self.close()
            raise
        # Experts sets per decoder layer: a decoder layer may hold several experts modules
        # (ERNIE-4.5-VL's text and vision experts), each its own pack layer, and a pass runs
        # only those its tokens route to (`_reach` passes the others).
        self.sets: dict[int, int] = {}
        for ref in blocks:
            self.sets[ref.decoder_layer] = self.sets.get(ref.decoder_layer, 0) + 1
        # How each pack layer is predicted when it is the next layer: "router" (its router on
        # the previous pack layer's input), "two_layer" (its router on the input of the same
        # experts set two pack layers before, when two-layer prediction is on: the pack layer
        # before it is another set of a decoder layer, which those tokens do not run), "none"
        # (the first layer of a set with no such layer before it), or "profile" (no router
        # returns the ids: the Window's expert profile stands in).
        self.prediction = [self._predicted_by(i) for i in range(len(blocks))]
        self.passed_layers = 0  # pack layers a pass moved past without running (`_reach`)
        try:
            self.filled_at_load = self._fill_when_everything_fits()
        except BaseException:
            self.close()
            raise

    def _check_routes(self, blocks: list[BlockRef]) -> None:
        """ConfigError where a block needs each route's output apart (a norm after each expert,
        or a forward of its own that calls the dispatch once per route) and the backend
        returns only the mixture."""
        why = self.window.per_entry_unsupported
        if self.on_cuda:  # moe_routed_device writes the mixture only
            why = why or "per-route outputs are computed on host memory only"
        # A forward of its own calls the dispatch once per route, top_k routes a token.
        per_route = self.top_k > 1
        need = [
            r for r in blocks if r.post_norm is not None or (r.family.own_forward and per_route)
        ]
        if why and need:
            ref = need[0]
            raise ConfigError(
                f"{ref.family.model_type}: experts module {ref.family.experts_class} (decoder "
                f"layer {ref.decoder_layer}) needs each route's expert output apart, before the "
                f"mixture; the {self.window.backend} backend returns only the mixture ({why})"
            )

    def _fill_when_everything_fits(self) -> bool:
        """An arena with a slot for every expert reads them all now, as plain from_pretrained
        reads every weight at load: nothing is then left to stream, no token waits on a cold
        miss, and no layer pays for the next layer's router, which only ever served to read
        ahead (Window.wants_predictions skips a layer resident for good). Returns whether it
        did."""
        return self.stream.fill()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.window.close()
            self.stream.close()

    def stats(self) -> dict[str, Any]:
        """Window.stats() and how each layer is predicted (`prediction`: per pack layer
        "router", "two_layer", "none" or "profile"; `prediction_profile_layers` and
        `prediction_two_layer_layers`, `prediction_none_layers`: how many are each), and
        `passed_layers`: pack layers (experts sets) the passes moved past without running."""
        stats = self.window.stats()
        stats["prediction"] = list(self.prediction)
        stats["prediction_profile_layers"] = self.prediction.count("profile")
        stats["prediction_two_layer_layers"] = self.prediction.count("two_layer")
        stats["prediction_none_layers"] = self.prediction.count("none")
        stats["passed_layers"] = self.passed_layers
        return stats

    def _predicts(self, layer: int, nxt: int) -> bool:
        """Whether the tokens of pack layer `layer` run pack layer `nxt` next (so that `nxt`'s
        router on this layer's input predicts what they read): a layer of a later decoder
        layer, the same experts set where that decoder layer holds several. A sibling set of
        this decoder layer runs other tokens (the vision experts beside the text ones)."""
        a, b = self.blocks[layer], self.blocks[nxt]
        if b.decoder_layer <= a.decoder_layer:
            return False
        return self.sets[b.decoder_layer] == 1 or a.path == b.path

    def _predicted_by(self, layer: int) -> str:
        if self.blocks[layer].router is None:
            return "profile"
        if layer == 0 or self._predicts(layer - 1, layer):
            return "router"
        return "two_layer" if layer >= 2 and self._predicts(layer - 2, layer) else "none"

    def _reach(self, layer: int) -> None:
        """Moves the Window's turn to pack layer `layer`: past the layers this pass did not
        run (the experts sets of a decoder layer none of its tokens chose), or, where the call
        is for a layer before the turn's (a new pass, the last one having stopped part-way: it
        failed, or its last sets ran no tokens), from a new turn at layer 0."""
        w = self.window
        nxt = w.next_layer if w.in_turn else 0
        if layer < nxt:
            w.restart_pass()
            nxt = 0
        self._pass_layers(nxt, layer)

    def leave_sets(self, last: int) -> None:
        """After a decoder layer with several experts sets ran (a forward hook on the module
        holding them, loader.py): moves the turn past its sets up to pack layer `last` that
        the pass did not run, so the turn ends with the pass. Nothing while several passes
        meet (`gather`: the serving thread drives the Window), or where the turn is already
        past them."""
        if self.gather is not None or self.closed or not self.window.in_turn:
            return
        nxt = self.window.next_layer
        if nxt == 0 or nxt > last:
            return
        self._pass_layers(nxt, last + 1)

    def _pass_layers(self, first: int, end: int) -> None:
        """Moves the turn past pack layers [first, end), which this pass runs no rows of."""
        for q in range(first, end):
            self.window.pass_layer(q)
            self.passed_layers += 1

    def predictions(self, layer: int, x: torch.Tensor) -> list[torch.Tensor | None]:
        """The ids routers l+1 (and l+2) pick on this layer's input, where the engine will use
        them (it decides: `Window.wants_predictions`), on x's device."""
        want = self.window.wants_predictions(layer, x.shape[0])
        out: list[torch.Tensor | None] = [None, None]
        for d in (1, 2):
            nxt = layer + d
            if want[d - 1] and nxt < len(self.blocks) and self._predicts(layer, nxt):
                ref = self.blocks[nxt]
                if ref.router is not None:
                    out[d - 1] = self._valid(route_ids(ref.router, x), x.shape[0])
        return out

    def _valid(self, ids: Any, rows: int) -> torch.Tensor | None:
        """A prediction as the Window takes it ([T, top_k] ids within the pack's experts), or
        None: a prediction only steers reads, so one out of shape is dropped and an id out of
        range becomes expert 0, neither of which can change the output."""
        if not isinstance(ids, torch.Tensor) or tuple(ids.shape) != (rows, self.top_k):
            return None
        n = self.stream.n_experts
        return torch.where((ids >= 0) & (ids < n), ids, torch.zeros_like(ids))

    def run(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """sum_k weights[:, k] * expert_{ids[:, k]}(x) for x [T, H], in x's dtype, on x's
        device (the engine's: the CPU, or the GPU the cuda backend runs on), each expert's
        output through the layer's post_norm first where it has one; through `gather` when it
        is set. ids and weights are [T, top_k], or [T, 1]: one route a row (`_routes`)."""
        gather = self.gather
        if gather is not None:
            return gather(layer, x, ids, weights)
        return self.run_rows(layer, x, ids, weights)

    @torch.no_grad()
    def run_rows(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """`run` itself: one engine call of every row of x. Each row's output is computed as
        it would be alone (the backends' kernels are per row), so rows of several sequences
        share one call, and one read of their experts' union."""
        if x.device != self.device:
            raise ConfigError(
                f"the streamed experts run on {self.device} ({self.window.backend} backend); "
                f"x is on {x.device}"
            )
        dtype = _X_DTYPES.get(x.dtype)
        if dtype is None:
            raise ConfigError(f"the streamed experts take float32, float16 or bfloat16, got "
                              f"{x.dtype}")  # fmt: skip
        # Past the sets this pass does not run; a forward pass that failed part-way leaves the
        # turn open at a later layer, which a call of an earlier one restarts.
        self._reach(layer)
        norm = self.blocks[layer].post_norm
        rows = x.numel() // self.hidden
        if ids.numel() not in (rows, rows * self.top_k):
            raise ConfigError(
                f"the experts were called with {ids.numel()} ids for {rows} rows; the pack "
                f"routes {self.top_k} a token, or one a row"
            )
        # An empty call (a set no token of the pass chose, ernie4_5_vl_moe's text experts on
        # image tokens alone) has as many ids as rows, and is no per-route call.
        per_route = 0 < rows == ids.numel() and self.top_k > 1
        if norm is not None or per_route:
            return self._routes(layer, x, ids, weights, norm, dtype)
        flat = x.detach().reshape(-1, self.hidden).contiguous()  # a view when already so
        preds = self.predictions(layer, flat)  # the routers take x in the model's dtype
        if self.on_cuda:
            # Queued on torch's stream before the routing's copy to the host, which waits for it.
            flat = flat.to(torch.float32)  # no copy when x is float32 already
        rows = flat.shape[0]
        tables = [ids.reshape(rows, self.top_k), weights.reshape(rows, self.top_k), *preds]
        if self.routing is not None:
            ids_h, weights_h, pred1, pred2 = self.routing.host_tables(tables)
        else:
            ids_h, weights_h, pred1, pred2 = _host_tables(tables)
        if self.on_cuda:
            # Made after the routing reached the host: torch's stream is idle, so no kernel of
            # its can still use this memory while the backend writes it on its own stream. The
            # call returns with the kernels queued and torch's stream waiting for them, so x and
            # out go back to torch's allocator only behind them (they are used on that stream).
            out = torch.empty_like(flat)
            stream = torch.cuda.current_stream(self.device).cuda_stream
            self.window.moe_routed_device(
                layer, flat, ids_h, weights_h, out, pred1, pred2, stream=stream
            )
            return out.to(x.dtype).reshape(x.shape)
        # bfloat16 has no numpy dtype: its bits go as int16, named by x_dtype.
        host = (flat.view(torch.int16) if flat.dtype == torch.bfloat16 else flat).numpy()
        y = self.window.moe_routed(
            layer,
            host,  # read in place through the buffer protocol
            ids_h,
            weights_h,
            pred1=pred1,
            pred2=pred2,
            arithmetic="float32",
            x_dtype=dtype,
        )
        return torch.from_numpy(y).to(x.dtype).reshape(x.shape)

    def _routes(
        self,
        layer: int,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        norm: Any,
        dtype: str,
    ) -> torch.Tensor:
        """`run_rows` where each route's expert output is needed apart, as the experts
        interface's backends compute it: each route's down-projection output (in x's dtype),
        through `norm` where the layer has one, times its weight, summed over the row's routes.

        ids [T, top_k]: the usual call, with a norm after each expert (muse_spark). ids [T, 1]:
        one route a row (ergo's own forward calls the dispatch with each token repeated once
        per route, unit weights): rows that come in runs of top_k equal rows are one token's
        routes, and are computed as that token's [top_k] routing (one expert pass, as the
        model's routing is); any other rows each name their one expert top_k times (the same
        expert's output, the rest unused), so any caller gets each row's own expert."""
        rows = x.numel() // self.hidden
        flat = x.detach().reshape(rows, self.hidden)
        width = ids.numel() // max(rows, 1)  # top_k, or 1 (run_rows checked)
        ids2, weights2 = ids.reshape(rows, width), weights.reshape(rows, width)
        k = self.top_k
        runs = flat.reshape(-1, k, self.hidden) if rows % k == 0 else None
        if width == k:
            entries = self._entries(layer, flat, ids2, dtype)  # [T, k, H]
        elif runs is not None and torch.equal(runs, runs[:, :1].expand(-1, k, -1)):
            tokens = runs[:, 0]
            entries = self._entries(layer, tokens, ids2.reshape(-1, k), dtype).reshape(rows, 1, -1)
        else:
            entries = self._entries(layer, flat, ids2.expand(rows, k), dtype)[:, :1]
        out = entries.to(x.dtype)
        if norm is not None:
            out = norm(out)
        mixed: torch.Tensor = (out * weights2.unsqueeze(-1)).sum(dim=1)
        return mixed.to(x.dtype).reshape(x.shape)

    def _entries(self, layer: int, flat: torch.Tensor, ids: torch.Tensor, dtype: str) -> Any:
        """Each route's expert output, unweighted ([T, top_k, H] float32) for x [T, H]."""
        flat = flat.contiguous()
        preds = self.predictions(layer, flat)
        ids_h, _, pred1, pred2 = _host_tables([ids, torch.ones_like(ids, dtype=torch.float32),
                                               *preds])  # fmt: skip
        host = (flat.view(torch.int16) if flat.dtype == torch.bfloat16 else flat).numpy()
        y = self.window.moe_routed(
            layer,
            host,
            ids_h,
            None,
            pred1=pred1,
            pred2=pred2,
            arithmetic="float32",
            x_dtype=dtype,
            per_entry=True,
        )
        return torch.from_numpy(y)


class _PinnedRouting:
    """The routing's tables copied from the GPU as they are, into pinned host memory kept from
    call to call, then one event waited for: no kernel, and one synchronization of torch's
    stream. `host_tables` reads the staging (copying out of it) before the next call may
    write it again: the lock keeps a second thread's copy off it meanwhile."""

    def __init__(self) -> None:
        self.staging: list[torch.Tensor | None] = [None] * 4
        self.done = torch.cuda.Event()  # type: ignore[no-untyped-call,unused-ignore]
        self.lock = threading.Lock()

    def host_tables(self, tables: list[torch.Tensor | None]) -> _HostRouting:
        with self.lock:
            return _host_tables(self.to_host(tables))

    def to_host(self, tables: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        out: list[torch.Tensor | None] = []
        for i, t in enumerate(tables):
            if t is None:
                out.append(None)
                continue
            t = t.detach()
            if t.dtype not in _HOST_WIDENS:  # a dtype the host does not widen: float32 first
                t = t.to(torch.float32)
            buf = self.staging[i]
            if buf is None or buf.dtype != t.dtype or buf.numel() < t.numel():
                buf = torch.empty(max(t.numel(), 64), dtype=t.dtype, pin_memory=True)
                self.staging[i] = buf
            host = buf[: t.numel()].view(t.shape)
            host.copy_(t, non_blocking=True)
            out.append(host)
        self.done.record()  # on torch's current stream, after x and the routing
        self.done.synchronize()
        return out


# What a routing table's dtype becomes on the host, value for value: ids int32, weights float32.
_HOST_WIDENS = {torch.int64, torch.int32, torch.float32, torch.bfloat16, torch.float16}


def _host_tables(tables: list[torch.Tensor | None]) -> _HostRouting:
    """The routing (host tensors: [T, k] ids, weights, predicted ids) as the binding's fresh
    C-contiguous int32 and float32 arrays. A bfloat16 weight widens by its bits (what torch's
    cast does); every other widening is numpy's exact one."""
    ids, weights, pred1, pred2 = tables
    assert ids is not None and weights is not None
    w = weights.detach()
    if w.dtype == torch.bfloat16:
        bits = w.view(torch.int16).numpy().view(np.uint16).astype(np.uint32) << 16
        weights_h = bits.view(np.float32)
    elif w.dtype in (torch.float32, torch.float16):
        weights_h = w.numpy().astype(np.float32)
    else:
        weights_h = w.to(torch.float32).numpy().copy()

    def ids_of(t: torch.Tensor | None) -> npt.NDArray[np.int32] | None:
        return None if t is None else t.detach().numpy().astype(np.int32)

    got = ids_of(ids)
    assert got is not None
    return got, weights_h, ids_of(pred1), ids_of(pred2)
