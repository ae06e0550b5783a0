"""The Python side of the peer comparison's GPU rows (benchmarks/peers/gpu_rows.py): token ids in,
timings, top-1 ids and GPU memory out, as llama_gpu_driver.cpp does for llama.cpp.

    python benchmarks/peers/gpu_driver.py ENGINE CHECKPOINT PACK IDS.bin PROMPT DECODE WARMUP
        DEVICE BUDGET OUT.json

ENGINE is one of:

- strata: strata_stream.transformers.load(CHECKPOINT, pack_path=PACK, device=DEVICE,
  arena_bytes=BUDGET): the dense weights in torch bf16 on DEVICE, the experts streamed from the
  pack through an arena of BUDGET bytes (on "cuda", the cuda backend).
- accelerate: transformers' from_pretrained with device_map="auto" and max_memory capping
  DEVICE at BUDGET bytes, the rest in host memory (accelerate's offload: the host-side weights
  are copied to the GPU for each forward). With DEVICE "cpu" (no GPU) the cap is host memory and
  the rest goes to disk (offload_folder), the same hooks on a machine without a GPU. accelerate
  keeps room on the GPU for the largest offloaded module (a decoder layer, its experts
  included), so a cap near the dense weights' bytes can leave every module in host memory.
- accelerate-experts: accelerate's offload with the device map written out, as llama.cpp's
  --n-cpu-moe places tensors: every module on DEVICE except the routed experts (`*.experts`) of
  the first layers, kept in host memory (on disk with DEVICE "cpu") until the rest fits BUDGET.
- plain: from_pretrained with every weight on DEVICE (BUDGET unused).
The first PROMPT ids go in as one forward pass, then DECODE ids one at a time with the KV cache
(teacher-forced), each timed, the argmax of each position's logits recorded (which waits for the
GPU). Unless WARMUP is 0, the same prompt and WARMUP decode steps first run on the ids rotated by
one, untimed, with their own cache. GPU memory (DEVICE "cuda"): device-wide used bytes from
torch.cuda.mem_get_info (the backend's own allocations included, which torch's counters miss)
after the load and after the last step, against before the load; torch's peak allocation too.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np


def _gpu_free(device: str) -> int | None:
    if not device.startswith("cuda"):
        return None
    import torch

    torch.cuda.synchronize()
    return int(torch.cuda.mem_get_info()[0])


def experts_map(checkpoint: str, device: str, budget: int) -> dict[str, int | str]:
    """A device map with every module on the device but the routed experts of the first layers,
    offloaded (host memory; disk where the device is the CPU) until the rest fits budget bytes."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    gpu = device.startswith("cuda")
    main: int | str = 0 if gpu else "cpu"
    away = "cpu" if gpu else "disk"
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            AutoConfig.from_pretrained(checkpoint), dtype=torch.bfloat16
        )

    def size(m: Any) -> int:
        return sum(p.numel() * p.element_size() for p in m.parameters())

    experts = [(n, size(m)) for n, m in skeleton.named_modules() if n.endswith(".experts")]
    kept = sum(b for _, b in experts)
    dense = size(skeleton) - kept
    offloaded = set()
    for name, b in experts:  # the first layers' experts go first, as --n-cpu-moe's do
        if dense + kept <= budget:
            break
        offloaded.add(name)
        kept -= b

    def split(module: Any, prefix: str) -> dict[str, int | str]:
        out: dict[str, int | str] = {}
        for name, child in module.named_children():
            full = prefix + name
            if full in offloaded:
                out[full] = away
            elif any(o.startswith(full + ".") for o in offloaded):
                out.update(split(child, full + "."))
            else:
                out[full] = main
        return out

    return split(skeleton, "")


def load_model(
    kind: str, checkpoint: str, pack: str, device: str, budget: int, scratch: str
) -> tuple[Any, Any]:
    """(model, strata engine or None); scratch: a folder for accelerate's disk offload."""
    import torch
    from transformers import AutoModelForCausalLM

    if kind == "strata":
        from strata_stream.transformers import load

        model = load(checkpoint, pack_path=pack, dtype=torch.bfloat16, device=device,
                     arena_bytes=budget, progress=False)  # fmt: skip
        return model, model.strata_engine
    if kind == "accelerate":
        gpu = device.startswith("cuda")
        max_memory: dict[int | str, int] = {0: budget, "cpu": 1 << 40} if gpu else {"cpu": budget}
        model = AutoModelForCausalLM.from_pretrained(
            checkpoint, dtype=torch.bfloat16, device_map="auto", max_memory=max_memory,
            offload_folder=scratch,
        )  # fmt: skip
        return model, None
    if kind == "accelerate-experts":
        model = AutoModelForCausalLM.from_pretrained(
            checkpoint, dtype=torch.bfloat16, offload_folder=scratch,
            device_map=experts_map(checkpoint, device, budget),
        )  # fmt: skip
        return model, None
    if kind == "plain":
        model = AutoModelForCausalLM.from_pretrained(
            checkpoint, dtype=torch.bfloat16, device_map={"": torch.device(device)}
        )
        return model, None
    raise SystemExit(
        f"gpu_driver: unknown engine {kind!r} (strata, accelerate, accelerate-experts or plain)"
    )


def main() -> None:
    if len(sys.argv) != 11:
        raise SystemExit(__doc__)
    kind, checkpoint, pack, ids_path = sys.argv[1:5]
    n_prompt, n_decode, n_warmup = (int(a) for a in sys.argv[5:8])
    device, budget, out = sys.argv[8], int(sys.argv[9]), Path(sys.argv[10])

    ids = [int(x) for x in np.fromfile(ids_path, dtype="<i4")]
    if len(ids) < n_prompt + n_decode or not 0 <= n_warmup <= n_decode:
        raise SystemExit("gpu_driver: IDS.bin holds fewer than PROMPT + DECODE ids, or WARMUP "
                         "is not from 0 to DECODE")  # fmt: skip
    scratch = tempfile.mkdtemp(prefix="peers-offload-")
    try:
        measure(
            kind,
            checkpoint,
            pack,
            ids,
            (n_prompt, n_decode, n_warmup),
            device,
            budget,
            out,
            scratch,
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def measure(
    kind: str,
    checkpoint: str,
    pack: str,
    ids: list[int],
    counts: tuple[int, int, int],
    device: str,
    budget: int,
    out: Path,
    scratch: str,
) -> None:
    import torch

    from strata_stream.serve.transformers_continuous import cache_argument

    n_prompt, n_decode, n_warmup = counts
    free_before = _gpu_free(device)
    t_load = time.perf_counter()
    model, engine = load_model(kind, checkpoint, pack, device, budget, scratch)
    model.eval()
    row: dict[str, Any] = {"load_s": time.perf_counter() - t_load}
    free_loaded = _gpu_free(device)
    # Inputs go where the embedding is (accelerate's hooks move them on from there).
    first = model.get_input_embeddings().weight.device
    where = torch.device(device) if first.type == "meta" else first
    key = cache_argument(model)

    def run(seq: list[int], steps: int) -> tuple[float, list[float], list[int]]:
        state: dict[str, Any] = {}

        @torch.no_grad()
        def step(part: list[int]) -> int:
            o = model(input_ids=torch.tensor([part], device=where), use_cache=True,
                      logits_to_keep=1, **state)  # fmt: skip
            state[key] = o[key]
            return int(o.logits[0, -1].argmax())  # waits for the GPU

        t0 = time.perf_counter()
        top1 = [step(seq[:n_prompt])]
        prompt_s = time.perf_counter() - t0
        times = []
        for i in range(steps):
            t0 = time.perf_counter()
            top1.append(step([seq[n_prompt + i]]))
            times.append(time.perf_counter() - t0)
        return prompt_s, times, top1

    if n_warmup:
        run(ids[1:] + ids[:1], n_warmup)
    if engine is not None:
        engine.window.reset_stats()
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    row["prompt_s"], row["step_s"], row["top1"] = run(ids, n_decode)
    free_after = _gpu_free(device)
    if free_before is not None and free_loaded is not None and free_after is not None:
        row["gpu_used_loaded_bytes"] = free_before - free_loaded
        row["gpu_used_bytes"] = free_before - free_after
        row["torch_peak_bytes"] = int(torch.cuda.max_memory_allocated())
    if kind.startswith("accelerate"):
        placed = getattr(model, "hf_device_map", {})
        row["device_map"] = {str(v): sum(1 for x in placed.values() if x == v)
                             for v in set(placed.values())}  # fmt: skip
    if engine is not None:
        total = engine.window.stats()["total"]
        hits, misses = int(total["hits"]), int(total["misses"])
        row["hit_rate"] = hits / (hits + misses) if hits + misses else None
        row["arena_bytes"] = int(engine.stream.n_slots * engine.stream.record_stride)
        row["engine_bytes_read"] = int(total["bytes_read"])  # the prompt and decode
        engine.close()
    out.write_text(json.dumps(row))


if __name__ == "__main__":
    main()
