"""The strata-stream side of benchmarks/peers: token ids in, timings and top-1 ids out, as
llama_driver.cpp does for llama.cpp.

    python benchmarks/peers/strata_driver.py mlx|transformers CHECKPOINT PACK|plain IDS.bin
        PROMPT DECODE THREADS ARENA OUT.json

mlx: the checkpoint (an mlx-lm 4-bit model) loads with strata_stream.mlx_lm.load, the experts
on the CPU backend; transformers: a Hugging Face checkpoint with strata_stream.transformers.load
(dense weights in torch bf16). The experts stream from PACK through an arena of ARENA bytes, or
"auto": sized by the library from the memory this process may have. PACK "plain" loads the
model with plain mlx-lm or plain transformers (every expert in memory: the run a user without
strata-stream makes). The first PROMPT ids go in as one forward pass, then DECODE ids one at a
time with the KV cache (teacher-forced), each timed, the argmax of each position's logits
recorded. The JSON adds the engine's figures over the decode steps, the storage bytes read
while decoding (/proc/self/io: every thread, the engine's IO threads included) and the
stream's own (its IO threads' reads into the arena, next-layer prefetch included, where the
Window's bytes_read counts the misses alone), the process's anonymous and file-backed resident
memory after decoding (/proc/self/status), and on the transformers path the dense weights'
bytes as the arena budget counted them (describe(): resident, left mapped, counted).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

Step = Callable[[list[int]], int]  # token ids in (with the cache), argmax of the last logits out


def storage_read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return -1


def resident_memory() -> dict[str, int]:
    """RssAnon, RssFile and RssShmem of this process (/proc/self/status), and of them what huge
    pages map (/proc/self/smaps_rollup), in bytes."""
    found = {}
    for source, keys in (
        ("/proc/self/status", ("RssAnon", "RssFile", "RssShmem")),
        ("/proc/self/smaps_rollup", ("AnonHugePages", "FilePmdMapped")),
    ):
        for line in Path(source).read_text().splitlines():
            key, _, value = line.partition(":")
            if key in keys:
                found[key] = int(value.split()[0]) * 1024
    return found


def mlx_model(
    checkpoint: str, pack: str, arena: int | None, threads: int
) -> tuple[Step, Any, dict[str, int] | None]:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    if pack == "plain":
        from mlx_lm import load as plain_load

        model, _ = plain_load(checkpoint)
        engine = None
    else:
        from strata_stream.mlx_lm import load

        model, _ = load(checkpoint, pack_path=pack, arena_bytes=arena, progress=False)
        engine = model.strata_engine
    cache = make_prompt_cache(model)

    def step(ids: list[int]) -> int:
        logits = model(mx.array(ids)[None], cache=cache)
        return int(mx.argmax(logits[0, -1]).item())

    return step, engine, None


def torch_model(
    checkpoint: str, pack: str, arena: int | None, threads: int
) -> tuple[Step, Any, dict[str, int] | None]:
    import torch

    from strata_stream.serve.transformers_continuous import cache_argument

    torch.set_num_threads(threads)
    if pack == "plain":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
        engine = None
        dense = None
    else:
        from strata_stream.transformers import load

        model = load(
            checkpoint, pack_path=pack, dtype=torch.bfloat16, progress=False, arena_bytes=arena
        )
        engine = model.strata_engine
        dense = model.strata_dense.as_dict()
    model.eval()
    key = cache_argument(model)  # the keyword this transformers takes the KV cache by
    state: dict[str, Any] = {}

    @torch.no_grad()  # type: ignore[misc]
    def step(ids: list[int]) -> int:
        o = model(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1, **state)
        state[key] = o[key]
        return int(o.logits[0, -1].argmax())

    return step, engine, dense


def main() -> None:
    engine_name, checkpoint, pack, ids_path = sys.argv[1:5]
    n_prompt, n_decode, threads = (int(a) for a in sys.argv[5:8])
    arena_arg, out = sys.argv[8], Path(sys.argv[9])
    ids = [int(x) for x in np.fromfile(ids_path, dtype="<i4")]
    arena = None if arena_arg == "auto" else int(arena_arg)
    t_load = time.perf_counter()
    make = mlx_model if engine_name == "mlx" else torch_model
    step, engine, dense = make(checkpoint, pack, arena, threads)
    row: dict[str, Any] = {"load_s": time.perf_counter() - t_load, "dense": dense}
    t0 = time.perf_counter()
    top1 = [step(ids[:n_prompt])]
    row["prompt_s"] = time.perf_counter() - t0
    experts_s = [0.0]  # wall time inside the experts calls while decoding (IO waits included)
    if engine is not None:
        engine.window.reset_stats()
        stream_before = dict(engine.stream.stats())
        run = engine.run

        def timed_run(*args: Any) -> Any:
            t = time.perf_counter()
            try:
                return run(*args)
            finally:
                experts_s[0] += time.perf_counter() - t

        engine.run = timed_run
    steps: list[float] = []
    read_before = storage_read_bytes()
    for i in range(n_decode):
        t0 = time.perf_counter()
        top1.append(step([ids[n_prompt + i]]))
        steps.append(time.perf_counter() - t0)
    row["decode_read_bytes"] = storage_read_bytes() - read_before
    row["resident"] = resident_memory()
    row["step_s"] = steps
    row["top1"] = top1
    if engine is not None:
        total = engine.window.stats()["total"]
        hits, misses = int(total["hits"]), int(total["misses"])
        row["hit_rate"] = hits / (hits + misses) if hits + misses else None
        row["engine_bytes_read_per_token"] = int(total["bytes_read"]) / n_decode  # misses
        stream_read = int(engine.stream.stats()["bytes_read"]) - int(stream_before["bytes_read"])
        row["stream_bytes_read_per_token"] = stream_read / n_decode  # prefetch included
        row["arena_bytes"] = int(engine.stream.n_slots * engine.stream.record_stride)
        # Where the decode time went: the experts calls (of which the host's waits on urgent
        # reads, stall_s), the rest of the model (attention, dense layers, head) by difference,
        # and the IO threads' own seconds over the same steps.
        stream = engine.stream.stats()
        row["decode_breakdown"] = {
            "experts_s": experts_s[0],
            "stall_s": float(total["stall_seconds"]),
            "handshake_s": float(total["handshake_seconds"]),
            "handshake_cpu_s": float(total["handshake_cpu_seconds"]),
            "rest_s": sum(steps) - experts_s[0],
            "io_read_s": float(stream["read_seconds"]) - float(stream_before["read_seconds"]),
            "direct_io": bool(stream["direct_io"]),
            "n_slots": int(stream["n_slots"]),
            "prefetch_state": engine.window.stats()["prefetch"].get("state"),
        }
        engine.close()
    out.write_text(json.dumps(row))


if __name__ == "__main__":
    main()
