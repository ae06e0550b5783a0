"""mlx-lm models whose routed experts stream from SSD through strata-stream.

    from strata_stream.mlx_lm import load
    from mlx_lm import generate

    model, tokenizer = load("path/to/mlx-model", arena_bytes=8 << 30)
    print(generate(model, tokenizer, "Hello", max_tokens=32))

`load` and `load_model` mirror mlx_lm.load and mlx_lm.utils.load_model. Only each MoE block's
experts module (its SwitchGLU) is replaced (blocks.py): the model's own block code routes and
mixes, whatever the family; the engine streams the chosen experts into a bounded arena and
computes them on the CPU backend (experts="cpu") or with the module's own gather_qmm over the
arena (experts="mlx"). docs/models.md has the seam, the two paths and their tolerances.

`sharded_load` mirrors mlx_lm.utils.sharded_load under `mlx.launch`: pipeline and/or tensor
parallel, each rank streaming only its share of the experts (docs/distributed.md).
"""

from __future__ import annotations

from strata_stream.mlx_lm.loader import (
    arena_size,
    default_pack_path,
    describe,
    load,
    load_model,
    stats_source,
)

__all__ = [
    "arena_size",
    "default_pack_path",
    "describe",
    "load",
    "load_model",
    "sharded_load",
    "stats_source",
]


def __getattr__(name: str) -> object:
    # Imported on first use: it needs mx.distributed, which plain loading does not.
    if name == "sharded_load":
        from strata_stream.mlx_lm.distributed import sharded_load

        return sharded_load
    raise AttributeError(name)
