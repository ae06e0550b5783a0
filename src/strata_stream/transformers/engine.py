"""The streaming engine under a transformers model: one ExpertStream and Window for all blocks.

Every streamed experts module calls `TorchMoeEngine.run(layer, ...)` in decoder order during a
forward pass; the Window's turn is the pass (it opens at pack layer 0, closes after the last).
Only the expert ids and weights (and the predicted ids) cross to the host as small arrays; x is
read in place from the torch CPU tensor, and the output comes back as a torch tensor over the
engine's float32 result, cast to x's dtype.
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

    def __init__(self, pack: ExpertPack, config: StreamConfig, blocks: list[BlockRef]) -> None:
        self.config = config
        self.blocks = blocks
        self.top_k = pack.geometry.top_k
        self.hidden = pack.geometry.hidden
        self.stream = ExpertStream(pack.path, config)
        try:
            self.window = Window(self.stream, backend="cpu")
        except BaseException:
            self.stream.close()
            raise
        self.closed = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.window.close()
            self.stream.close()

    def predictions(self, layer: int, x: torch.Tensor) -> list[npt.NDArray[np.int32] | None]:
        """The ids routers l+1 (and l+2 when the engine asks) pick on this layer's input."""
        rows = x.shape[0]
        wants = getattr(self.window, "wants_predictions", None)
        if wants is not None:  # the engine decides which distances it uses
            want = list(wants(layer, rows))
        else:
            c = self.config
            two = c.decode_prefetch2 if rows <= c.decode_rows else c.prompt_pred2
            want = [c.lookahead, c.lookahead and two]
        out: list[npt.NDArray[np.int32] | None] = [None, None]
        for d in (1, 2):
            nxt = layer + d
            if want[d - 1] and nxt < len(self.blocks):
                ref = self.blocks[nxt]
                out[d - 1] = _host_ids(route_ids(ref.block, ref.family, x))
        return out

    @torch.no_grad()
    def run(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """sum_k weights[:, k] * expert_{ids[:, k]}(x) for x [T, H], in x's dtype."""
        if x.device.type != "cpu":
            raise ConfigError(
                f"the streamed experts run on the CPU backend; x is on {x.device} (a CUDA "
                "device is not supported yet)"
            )
        dtype = _X_DTYPES.get(x.dtype)
        if dtype is None:
            raise ConfigError(f"the streamed experts take float32, float16 or bfloat16, got "
                              f"{x.dtype}")  # fmt: skip
        if layer == 0:
            # A forward pass that failed part-way leaves the turn open at a later layer.
            self.window.restart_pass()
        flat = x.detach().reshape(-1, self.hidden).contiguous()  # a view when already so
        preds = self.predictions(layer, flat)
        # bfloat16 has no numpy dtype: its bits go as int16, named by x_dtype.
        host = (flat.view(torch.int16) if flat.dtype == torch.bfloat16 else flat).numpy()
        out = self.window.moe_routed(
            layer,
            host,  # read in place through the buffer protocol
            _host_ids(ids.reshape(-1, self.top_k)),
            weights.detach().reshape(-1, self.top_k).to(torch.float32).numpy(),
            pred1=preds[0],
            pred2=preds[1],
            arithmetic="float32",
            x_dtype=dtype,
        )
        return torch.from_numpy(out).to(x.dtype).reshape(x.shape)


def _host_ids(ids: torch.Tensor) -> npt.NDArray[np.int32]:
    return ids.detach().to(torch.int32).numpy()
