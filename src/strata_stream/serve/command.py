"""`strata-stream serve MODEL`: load the model, build the app, serve it until interrupted."""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

from strata_stream.errors import ConfigError
from strata_stream.serve.config import ServeConfig
from strata_stream.serve.server import LOOPBACK, listen, run_foreground

log = logging.getLogger("strata_stream.serve")


def serve(
    model_path: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8080,
    arena_gb: float | None = None,
    model_id: str | None = None,
    max_queue: int = 64,
    max_batch: int | None = None,
    prefill_chunk: int = 512,
    context_length: int | None = None,
    default_max_tokens: int = 512,
    log_level: str = "info",
    distributed: str | None = None,
    experts: str = "cpu",
    pack_path: str | None = None,
    engine: str = "mlx-lm",
    device: str | None = None,
    prompt_cache_dir: str | None = None,
    prompt_cache_gb: float = 8.0,
    prompt_cache_memory_gb: float = 1.0,
) -> None:
    """Serves MODEL until interrupted. `distributed` ("pipeline" or "tensor", under
    mlx.launch): every rank loads its share with strata_stream.mlx_lm.sharded_load; rank 0
    serves HTTP, the others follow it (serve/lockstep.py) and return when it stops.
    `pack_path`: the model's pack (default: the cache's, converted on first use).
    `engine`: "mlx-lm" or "transformers" (strata_stream.transformers.load on `device`).
    max_batch None: 8.
    `prompt_cache_dir`: where prompt caches persist across restarts, at most `prompt_cache_gb`
    GiB of files; `prompt_cache_memory_gb`: those kept in memory (serve/prompt_cache.py)."""
    from strata_stream.serve.app import create_app
    from strata_stream.serve.loader import load_for_serving

    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if arena_gb is not None and not (math.isfinite(arena_gb) and arena_gb > 0):
        raise ConfigError(f"--arena-gb must be a number of GiB > 0, got {arena_gb}")
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port must be 0..65535, got {port}")
    if max_batch is None:
        max_batch = 8
    if engine == "transformers" and (distributed is not None or experts != "cpu"):
        raise ConfigError("--pipeline, --tensor and --experts are for --engine mlx-lm")
    if distributed is not None and prompt_cache_dir is not None:
        raise ConfigError("--prompt-cache-dir is not served across ranks (--pipeline/--tensor)")
    if prompt_cache_dir is not None:
        _check_directory(Path(prompt_cache_dir))
    if host not in LOOPBACK:
        log.warning("binding to %s: the server is reachable from other machines", host)
    config = ServeConfig(
        model_id=model_id or Path(model_path.rstrip("/")).name or model_path,
        max_queue=max_queue,
        max_batch=max_batch,
        prefill_chunk=prefill_chunk,
        context_length=context_length,
        default_max_tokens=default_max_tokens,
        prompt_cache_memory_gb=prompt_cache_memory_gb,
        prompt_cache_dir=prompt_cache_dir,
        prompt_cache_gb=prompt_cache_gb,
    )
    arena_bytes = None if arena_gb is None else int(arena_gb * 2**30)
    if distributed is not None:
        _serve_distributed(model_path, distributed, experts, arena_bytes, config, host, port,
                           log_level)  # fmt: skip
        return
    # The port first: one already in use fails now, not after the model has loaded.
    sock = listen(host, port)
    try:
        loaded = load_for_serving(model_path, arena_bytes=arena_bytes, pack_path=pack_path,
                                  engine=engine, device=device)  # fmt: skip
        try:
            app = create_app(loaded.model, loaded.tokenizer, config, stats=loaded.stats,
                             engine=loaded.engine)  # fmt: skip
            log.info("serving %s as model id '%s' (%s)", model_path, config.model_id, engine)
            run_foreground(app, host, port, log_level=log_level, sock=sock)
        finally:
            engine_handle = getattr(loaded.model, "strata_engine", None)
            if engine_handle is not None:
                engine_handle.close()
    finally:
        sock.close()


def _check_directory(d: Path) -> None:
    """The prompt cache directory exists (made if not) and takes files: found before the
    model loads, in one line."""
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / f".strata-write-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"--prompt-cache-dir {d}: {e.strerror or e}") from None


def _serve_distributed(
    model_path: str,
    mode: str,
    experts: str,
    arena_bytes: int | None,
    config: ServeConfig,
    host: str,
    port: int,
    log_level: str,
) -> None:

    from strata_stream.mlx_lm import stats_source
    from strata_stream.mlx_lm.distributed import load_split
    from strata_stream.serve.app import create_app
    from strata_stream.serve.follower import follow
    from strata_stream.serve.lockstep import RequestChannel

    model, tokenizer, group = load_split(model_path, mode, arena_bytes=arena_bytes, experts=experts)
    channel = RequestChannel(group)
    if group.rank() != 0:
        served = follow(model, tokenizer, channel, max_batch=config.max_batch,
                        prefill_chunk=config.prefill_chunk)  # fmt: skip
        log.info("rank %d: rank 0 stopped after %d requests", group.rank(), served)
        return
    stats = stats_source(model) if getattr(model, "strata_engine", None) is not None else None
    app = create_app(model, tokenizer, config, stats=stats, lockstep=channel)
    log.info("serving %s as model id '%s' on %d ranks (%s)", model_path, config.model_id,
             group.size(), mode)  # fmt: skip
    run_foreground(app, host, port, log_level=log_level)
