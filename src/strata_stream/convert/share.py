"""One rank's share of a model's routed experts under MLX distributed (pipeline and tensor).

Pipeline parallelism (mlx-lm's ``model.model.pipeline(group)``) gives a rank a range of decoder
layers: its pack holds only the experts of the MoE layers in that range, renumbered from pack
layer 0. Tensor parallelism (``model.shard(group)``, ``shard_inplace`` of ``switch_mlp``) gives a
rank a slice of every expert's intermediate dimension: rows ``[r*I/N, (r+1)*I/N)`` of gate and
up ("all-to-sharded", axis -2) and the same columns of down ("sharded-to-all", axis -1). For
quantized experts the slice must be whole quantization groups, since down's scales and biases
are split along the same axis as its packed words.

The share is recorded in the pack's "model" metadata (``"share"``), so a pack converted for one
rank is refused by another, and it is part of the pack's cache name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from strata_stream.errors import ConfigError


@dataclass(frozen=True)
class Share:
    """What one rank holds: decoder layers ``[layers[0], layers[1])`` (None: every layer) and
    slice ``tp_rank`` of ``tp_size`` of every expert's intermediate dimension."""

    layers: tuple[int, int] | None = None
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        if self.layers is not None:
            start, end = self.layers
            if not 0 <= start < end:
                raise ConfigError(f"share layers [{start}, {end}) is not a non-empty range")
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(
                f"share tensor slice {self.tp_rank} of {self.tp_size} is not a valid rank"
            )

    @property
    def whole(self) -> bool:
        return self.layers is None and self.tp_size == 1

    def holds_layer(self, decoder_layer: int) -> bool:
        return self.layers is None or self.layers[0] <= decoder_layer < self.layers[1]

    def suffix(self) -> str:
        """The pack cache name's tail: ``-pp{start}-{end}`` and/or ``-tp{r}of{N}``."""
        out = ""
        if self.layers is not None:
            out += f"-pp{self.layers[0]}-{self.layers[1]}"
        if self.tp_size > 1:
            out += f"-tp{self.tp_rank}of{self.tp_size}"
        return out

    def intermediate_slice(
        self, moe_intermediate: int, group_size: int, quantized: bool
    ) -> tuple[int, int]:
        """Rows [begin, end) of the intermediate dimension this rank holds; ConfigError naming
        the numbers when the dimension does not split into whole quantization groups."""
        n = self.tp_size
        if moe_intermediate % n:
            raise ConfigError(
                f"tensor parallel over {n} ranks needs moe_intermediate ({moe_intermediate}) "
                f"divisible by {n}"
            )
        part = moe_intermediate // n
        if quantized and part % group_size:
            raise ConfigError(
                f"tensor parallel over {n} ranks gives each rank {part} of the experts' "
                f"{moe_intermediate} intermediate rows, not a whole number of quantization "
                f"groups of {group_size} (mlx-lm splits down's scales along the same axis)"
            )
        return self.tp_rank * part, (self.tp_rank + 1) * part

    def to_json(self) -> dict[str, Any]:
        return {
            "layers": None if self.layers is None else list(self.layers),
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
        }

    @classmethod
    def from_json(cls, data: Any) -> Share:
        if data is None:
            return cls()
        layers = data.get("layers")
        return cls(
            None if layers is None else (int(layers[0]), int(layers[1])),
            int(data.get("tp_rank", 0)),
            int(data.get("tp_size", 1)),
        )

    def describe(self) -> str:
        parts = []
        if self.layers is not None:
            parts.append(f"decoder layers {self.layers[0]}..{self.layers[1] - 1}")
        if self.tp_size > 1:
            parts.append(f"tensor slice {self.tp_rank} of {self.tp_size}")
        return ", ".join(parts) or "the whole model"


WHOLE = Share()
