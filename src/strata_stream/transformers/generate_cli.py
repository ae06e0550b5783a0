"""`strata-stream generate MODEL --engine transformers`: text as it is generated, then figures.

Greedy decoding through `model.generate` with a TextStreamer; prompt and decode are reported
apart (the Window's counters are snapshotted when the first new token arrives).
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from strata_stream.config import StreamConfig
from strata_stream.engine_choice import Lines, check_transformers_can_read
from strata_stream.paths import model_dir
from strata_stream.units import human_bytes

_COUNTERS = ("hits", "misses", "bytes_read", "stall_seconds")


def generate(
    model_path: str,
    prompt: str,
    *,
    max_tokens: int = 100,
    arena_gb: float | None = None,
    pack_path: str | None = None,
    device: str | None = None,
    out: TextIO | None = None,
) -> dict[str, Any]:
    """Generates greedily with streamed experts, printing as it goes (to `out`, default the
    sys.stdout of the moment); returns the figures."""
    import torch
    from transformers import AutoTokenizer, TextStreamer

    from strata_stream.transformers.loader import load

    sink: TextIO = sys.stdout if out is None else out
    arena = None if arena_gb is None else int(arena_gb * (1 << 30))
    local = model_dir(model_path)  # fetched as load() would, to look at its config first
    check_transformers_can_read(local)
    model = load(str(local), arena_bytes=arena, pack_path=pack_path, device=device,
                 config=StreamConfig.from_env(), progress=True)  # fmt: skip
    engine = model.strata_engine
    tokenizer = AutoTokenizer.from_pretrained(model.strata_model_dir)
    window = engine.window
    marks: list[tuple[float, dict[str, Any]]] = []

    class _Printer(TextStreamer):  # type: ignore[misc,unused-ignore]
        def put(self, value: Any) -> None:
            if not self.next_tokens_are_prompt and not marks:
                marks.append((time.perf_counter(), window.stats()["total"]))
            super().put(value)  # type: ignore[no-untyped-call,unused-ignore]

        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            lines.write(text)
            lines.flush()

    try:
        inputs = tokenizer(prompt, return_tensors="pt")
        prompt_tokens = int(inputs["input_ids"].shape[1])
        start, t0 = window.stats()["total"], time.perf_counter()
        with torch.no_grad(), Lines(sink) as lines:  # an error mid-text gets a line of its own
            ids = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False,
                                 streamer=_Printer(tokenizer, skip_prompt=True))  # fmt: skip
        t1, end = time.perf_counter(), window.stats()["total"]
        sink.write("\n")
        new = int(ids.shape[1]) - prompt_tokens
        if not marks:
            return {}
        t_first, at_first = marks[0]
        figures = {}
        for name, a, b, tokens, secs in (
            ("prompt", start, at_first, prompt_tokens, t_first - t0),
            ("decode", at_first, end, max(0, new - 1), t1 - t_first),
        ):
            d = {k: float(b[k]) - float(a[k]) for k in _COUNTERS}
            looked = d["hits"] + d["misses"]
            hit = f"{d['hits'] / looked:.1%}" if looked else "n/a"
            tps = tokens / secs if secs > 0 else 0.0
            print(f"{name:<7} {tokens} tokens, {tps:.2f} tok/s, hit rate {hit}, "
                  f"{d['bytes_read'] / 1e9:.3f} GB read", file=sink)  # fmt: skip
            figures[name] = {**d, "tokens": tokens, "tps": tps}
        print(f"arena   {human_bytes(engine.config.arena_bytes)}, "
              f"{engine.stream.n_slots} expert slots, experts on cpu (transformers)",
              file=sink)  # fmt: skip
        return figures
    finally:
        engine.close()
