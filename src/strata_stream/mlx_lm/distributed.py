"""`sharded_load`: an mlx-lm model spread over ranks with MLX distributed, experts streamed.

Mirrors ``mlx_lm.utils.sharded_load``: the model is built lazily, sharded with the model's own
``shard(tensor_group)`` and/or ``model.model.pipeline(pipeline_group)`` exactly as mlx-lm does,
and only then do the rank's MoE blocks get their streamed stand-ins, from a pack holding the
rank's share alone (convert/share.py): the experts of its pipeline layers, its tensor slice of
every expert. The expert tensors stay lazy and are dropped before the dense weights are
evaluated, so the sharding's slices of them are never computed and their shards never read.

What crosses the network is what plain sharded mlx-lm sends: the pipeline's send/recv and
all_gather of the hidden state, the tensor-parallel all_sum of each block's output (the block's
own code, on both expert paths: only its experts module is streamed). Routing, prediction and
the handshake are per rank. `gather_stats` is the one addition, a small all_gather the caller
makes once at the end of a generation, not per token.

Memory: each rank sizes its arena from its own available memory, divided by the number of
ranks on its host (`local_ranks`).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from strata_stream.config import StreamConfig, local_ranks_env
from strata_stream.convert.share import Share
from strata_stream.errors import ConfigError
from strata_stream.mlx_lm.loader import stream_experts
from strata_stream.paths import model_location

# The figures of Window.stats()["total"] summed over ranks by `sum_stats`.
SUMMED = ("tokens", "hits", "misses", "bytes_read", "pred_correct", "pred_actual")
_LOOPBACK_PREFIX = "127."
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def local_ranks(rank: int | None = None, hostfile: str | None = None) -> int:
    """How many ranks of this launch run on this host, so they split its memory.

    STRATA_LOCAL_RANKS wins when set. Otherwise the ring backend's hostfile (MLX_HOSTFILE,
    written by mlx.launch: one list of "ip:port" per rank) is read, and the ranks whose first
    address equals this rank's are counted, every loopback address counting as this host.
    With no hostfile (a single process, or another backend), 1.
    """
    n = local_ranks_env()
    if n is not None:
        return n
    path = hostfile if hostfile is not None else os.environ.get("MLX_HOSTFILE")
    if rank is None:
        rank = int(os.environ.get("MLX_RANK", "0") or 0)
    if not path or not os.path.exists(path):
        return 1
    try:
        hosts = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return 1
    if not isinstance(hosts, list) or not 0 <= rank < len(hosts):
        return 1

    def host_of(entry: Any) -> str | None:
        first = entry[0] if isinstance(entry, list) and entry else entry
        if not isinstance(first, str):
            return None
        ip = first.rsplit(":", 1)[0]
        return "loopback" if ip.startswith(_LOOPBACK_PREFIX) or ip == "[::1]" else ip

    mine = host_of(hosts[rank])
    if mine is None:
        return 1
    return max(1, sum(1 for h in hosts if host_of(h) == mine))


_NO_WEIGHTS = ["*.json", "*.py", "tokenizer.model", "*.tiktoken", "tiktoken.model", "*.txt",
               "*.jsonl", "*.jinja"]  # fmt: skip


def _fetch_share(repo: str | os.PathLike[str], model_path: Path, model: Any) -> Path:
    """The weight files this rank needs, fetched as mlx-lm's sharded_load fetches them: for a
    pipeline rank the shards holding its layers (and the layer-less tensors: embeddings, norm,
    head), else all. ConfigError when a pipeline's checkpoint has no weight index."""
    from mlx_lm.utils import _download

    inner = getattr(model, "model", None)
    start, end = getattr(inner, "start_idx", 0), getattr(inner, "end_idx", None)
    if getattr(inner, "pipeline_size", 1) <= 1 or end is None:
        return Path(_download(str(repo)))
    index = model_path / "model.safetensors.index.json"
    if not index.exists():
        raise ConfigError(f"{repo}: no model.safetensors.index.json to find a pipeline's shards")
    files: set[str] = set()
    for name, file in json.loads(index.read_text())["weight_map"].items():
        m = _LAYER.search(name)
        if m is None or start <= int(m.group(1)) < end:
            files.add(file)
    return Path(_download(str(repo), allow_patterns=sorted(files)))


def rank_share(model: Any, pipeline_group: Any | None, tensor_group: Any | None) -> Share:
    """The share of a model after mlx-lm's pipeline/shard calls for these groups."""
    layers = None
    if pipeline_group is not None:
        inner = model.model
        layers = (int(inner.start_idx), int(inner.end_idx))
    if tensor_group is not None:
        return Share(layers, tensor_group.rank(), tensor_group.size())
    return Share(layers)


def sharded_load(
    path_or_repo: str | os.PathLike[str],
    *,
    pipeline_group: Any | None = None,
    tensor_group: Any | None = None,
    arena_bytes: int | str | None = None,
    config: StreamConfig | None = None,
    experts: str = "cpu",
    arithmetic: str = "auto",
    pack_path: str | os.PathLike[str] | None = None,
    progress: bool = True,
    return_config: bool = False,
    tokenizer_config: dict[str, Any] | None = None,
    trust_remote_code: bool = False,
) -> Any:
    """As ``mlx_lm.utils.sharded_load``: (model, tokenizer) [+ config] of this rank, with the
    routed experts of its share streamed from its own pack.

    pipeline_group / tensor_group: as mlx-lm (neither: tensor parallel over the world group if
    the model supports it, else pipeline). arena_bytes: this rank's expert memory (None: from
    this host's available memory divided by its local ranks, see `local_ranks`). pack_path:
    this rank's pack (default: converted on first load into the cache, named by the share).
    See `strata_stream.mlx_lm.load_model` for config, experts and arithmetic.
    """
    from mlx_lm.utils import _download, load_tokenizer
    from mlx_lm.utils import load_model as mlx_load_model

    # As mlx-lm: everything but the weights first; the weights this rank needs once its layers
    # are known (_fetch_share). A local directory is used as it is.
    location = model_location(path_or_repo)  # a mistyped local path is refused, not fetched
    model_path = Path(_download(location, allow_patterns=_NO_WEIGHTS))
    model, model_cfg = mlx_load_model(
        model_path, lazy=True, strict=False, trust_remote_code=trust_remote_code
    )
    has_pipelining = hasattr(model, "model") and hasattr(model.model, "pipeline")
    has_tensor_parallel = hasattr(model, "shard")
    kind = model_cfg.get("model_type", "?")
    if pipeline_group is not None and not has_pipelining:
        raise ConfigError(f"{kind}: mlx-lm has no pipeline for this model")
    if tensor_group is not None and not has_tensor_parallel:
        raise ConfigError(f"{kind}: mlx-lm has no tensor parallel shard for this model")
    if not has_pipelining and not has_tensor_parallel:
        raise ConfigError(f"{kind}: mlx-lm supports no sharding of this model")
    if pipeline_group is None and tensor_group is None:
        if has_tensor_parallel:
            tensor_group = mx.distributed.init()
        else:
            pipeline_group = mx.distributed.init()

    if not Path(path_or_repo).exists():
        # A Hugging Face repo: fetch this rank's weights (a pipeline rank: its layers' shards
        # only), then build the model again over them, as mlx-lm does.
        if pipeline_group is not None:
            model.model.pipeline(pipeline_group)
        model_path = _fetch_share(location, model_path, model)
        model, model_cfg = mlx_load_model(
            model_path, lazy=True, strict=False, trust_remote_code=trust_remote_code
        )
    # mlx-lm's order: shard, then pipeline, both on the lazy model.
    if tensor_group is not None:
        model.shard(tensor_group)
    if pipeline_group is not None:
        model.model.pipeline(pipeline_group)
    share = rank_share(model, pipeline_group, tensor_group)
    engine = stream_experts(
        model,
        model_path,
        arena_bytes=arena_bytes,
        config=config,
        pack_path=pack_path,
        experts=experts,
        arithmetic=arithmetic,
        progress=progress,
        lazy=False,
        share=share,
        memory_share=local_ranks(mx.distributed.init().rank()),
    )
    object.__setattr__(model, "strata_share", share)
    if engine is None:
        object.__setattr__(model, "strata_engine", None)
    tokenizer = load_tokenizer(  # type: ignore[no-untyped-call]
        model_path,
        tokenizer_config or {"trust_remote_code": True},
        eos_token_ids=model_cfg.get("eos_token_id", None),
    )
    # As mlx-lm: synchronise the ranks, so none times out waiting for a slow loader.
    mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu))
    if return_config:
        return model, tokenizer, model_cfg
    return model, tokenizer


SPLITS = ("pipeline", "tensor")


def load_split(
    path_or_repo: str | os.PathLike[str], split: str, **kwargs: Any
) -> tuple[Any, Any, Any]:
    """(model, tokenizer, group) for the `--pipeline` / `--tensor` commands: `sharded_load`
    over the world group mlx.launch set up, split one way, showing progress on rank 0 only.
    kwargs go to sharded_load."""
    if split not in SPLITS:
        raise ConfigError(f"split must be pipeline or tensor, got {split!r}")
    group = mx.distributed.init()
    model, tokenizer = sharded_load(
        path_or_repo,
        pipeline_group=group if split == "pipeline" else None,
        tensor_group=group if split == "tensor" else None,
        progress=group.rank() == 0,
        **kwargs,
    )
    return model, tokenizer, group


def rank_stats(model: Any) -> dict[str, Any]:
    """This rank's engine figures: Window.stats()["total"] plus the arena and share."""
    engine = getattr(model, "strata_engine", None)
    share: Share = getattr(model, "strata_share", Share())
    out: dict[str, Any] = {"share": share.to_json()}
    if engine is None:
        out.update({k: 0 for k in SUMMED})
        out["arena_bytes"] = 0
        return out
    total = engine.window.stats()["total"]
    out.update({k: int(total[k]) for k in SUMMED})
    out["stall_seconds"] = float(total.get("stall_seconds", 0.0))
    out["arena_bytes"] = int(engine.config.arena_bytes)
    return out


def gather_stats(stats: dict[str, Any], group: Any | None = None) -> list[dict[str, int]]:
    """The SUMMED figures of every rank, in rank order, from one all_gather of a small int64
    array (every rank must call it, once, at the same point: the end of a generation).

    mlx-lm's generate_step leaves one step in flight on its generation stream when it stops
    (it computes the token after the last one it yields); with a pipeline that step holds an
    all_gather, and a collective issued on another stream meanwhile would pair with it on the
    other rank. So the generation stream is drained first."""
    from mlx_lm.generate import generation_stream

    mx.synchronize(generation_stream)
    mx.synchronize()
    values = mx.array([int(stats[k]) for k in SUMMED], dtype=mx.int64)
    gathered = mx.distributed.all_gather(values, group=group, stream=mx.cpu)
    mx.eval(gathered)
    rows = np.array(gathered, dtype=np.int64).reshape(-1, len(SUMMED))
    return [{k: int(v) for k, v in zip(SUMMED, row, strict=True)} for row in rows]


def sum_stats(stats: dict[str, Any], group: Any | None = None) -> dict[str, int]:
    """The SUMMED figures added over ranks (see gather_stats)."""
    ranks = gather_stats(stats, group)
    return {k: sum(r[k] for r in ranks) for k in SUMMED}


__all__ = [
    "SUMMED",
    "gather_stats",
    "local_ranks",
    "rank_share",
    "rank_stats",
    "sharded_load",
    "sum_stats",
]
