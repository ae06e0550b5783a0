"""The streaming engine under a transformers model: one ExpertStream and Window for all blocks.

Every streamed experts module calls `TorchMoeEngine.run(layer, ...)` in decoder order during a
forward pass; the Window's turn is the pass (it opens at pack layer 0, closes after the last).
Only the expert ids and weights (and the predicted ids) cross to the host, as one small array
(one copy, so on a GPU one synchronization of torch's stream per layer).
- CPU: x is read in place from the torch tensor, and the output comes back as a torch tensor
  over the engine's float32 result, cast to x's dtype.
- CUDA: the Window is on the cuda backend; x (float32: a bfloat16 or float16 x is widened in
  torch) is read in place from the torch CUDA tensor and the output is written into a torch
  CUDA tensor by the backend, which returns once its own stream drained. The host copy of the
  routing is what orders the two streams: when it arrives, torch's stream has finished x.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from strata_stream.config import StreamConfig
from strata_stream.errors import ConfigError
from strata_stream.pack.reader import ExpertPack
from strata_stream.stream import ExpertStream
from strata_stream.transformers.families import Family, route_ids
from strata_stream.window import Window

_X_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


@dataclass
class BlockRef:
    """One sparse block of the model and its place in the pack."""

    layer: int  # pack layer
    decoder_layer: int
    block: Any  # the model's own block (router, shared experts, ...)
    family: Family


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
        self.closed = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.window.close()
            self.stream.close()

    def predictions(self, layer: int, x: torch.Tensor) -> list[torch.Tensor | None]:
        """The ids routers l+1 (and l+2) pick on this layer's input, where the engine will use
        them (it decides: `Window.wants_predictions`), on x's device."""
        want = self.window.wants_predictions(layer, x.shape[0])
        out: list[torch.Tensor | None] = [None, None]
        for d in (1, 2):
            nxt = layer + d
            if want[d - 1] and nxt < len(self.blocks):
                ref = self.blocks[nxt]
                out[d - 1] = route_ids(ref.block, ref.family, x)
        return out

    @torch.no_grad()
    def run(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """sum_k weights[:, k] * expert_{ids[:, k]}(x) for x [T, H], in x's dtype, on x's
        device (the engine's: the CPU, or the GPU the cuda backend runs on)."""
        if x.device != self.device:
            raise ConfigError(
                f"the streamed experts run on {self.device} ({self.window.backend} backend); "
                f"x is on {x.device}"
            )
        dtype = _X_DTYPES.get(x.dtype)
        if dtype is None:
            raise ConfigError(f"the streamed experts take float32, float16 or bfloat16, got "
                              f"{x.dtype}")  # fmt: skip
        if layer == 0:
            # A forward pass that failed part-way leaves the turn open at a later layer.
            self.window.restart_pass()
        flat = x.detach().reshape(-1, self.hidden).contiguous()  # a view when already so
        preds = self.predictions(layer, flat)  # the routers take x in the model's dtype
        if self.on_cuda:
            # Queued on torch's stream before the routing's copy to the host, which waits for it.
            flat = flat.to(torch.float32)  # no copy when x is float32 already
        rows = flat.shape[0]
        ids_h, weights_h, pred1, pred2 = _routing_to_host(
            ids.reshape(rows, self.top_k), weights.reshape(rows, self.top_k), preds
        )
        if self.on_cuda:
            # Made after the routing reached the host: torch's stream is idle, so no kernel of
            # its can still use this memory while the backend writes it on its own stream.
            out = torch.empty_like(flat)
            self.window.moe_routed_device(layer, flat, ids_h, weights_h, out, pred1, pred2)
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


def _routing_to_host(
    ids: torch.Tensor, weights: torch.Tensor, preds: list[torch.Tensor | None]
) -> tuple[
    npt.NDArray[np.int32],
    npt.NDArray[np.float32],
    npt.NDArray[np.int32] | None,
    npt.NDArray[np.int32] | None,
]:
    """The routing ([T, k] ids, float32 weights, predicted ids) as host arrays, in one copy:
    on a GPU, one synchronization of torch's stream instead of one per table."""
    k = ids.shape[1]
    parts = [ids.detach().to(torch.int32), weights.detach().to(torch.float32).view(torch.int32)]
    parts += [p.detach().to(torch.int32) for p in preds if p is not None]
    host = torch.cat(parts, dim=1).cpu().numpy()  # [T, k * tables]
    tables = [np.ascontiguousarray(host[:, i * k : (i + 1) * k]) for i in range(len(parts))]
    out_preds: list[npt.NDArray[np.int32] | None] = []
    rest = iter(tables[2:])
    for p in preds:
        out_preds.append(None if p is None else next(rest))
    return tables[0], tables[1].view(np.float32), out_preds[0], out_preds[1]
