"""strata_stream.transformers with an arena that holds every expert reads them all at load:
no token then waits on a cold miss and no layer runs the next layer's router, and the logits
are bitwise those of a small arena's run (I11)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from strata_stream import ExpertPack, StreamConfig  # noqa: E402
from strata_stream.convert import convert  # noqa: E402
from strata_stream.transformers import load  # noqa: E402
from strata_stream.transformers.random_model import make_checkpoint  # noqa: E402

BASE = StreamConfig(io_threads=2, direct_io=False, persist_profile=False)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("hf_fill")
    path = make_checkpoint("qwen3_moe", root / "qwen3_moe")
    return path, convert(path, root / "qwen3_moe.strpk", progress=False)


def _logits_and_stats(
    path: Path, pack: Path, arena: int
) -> tuple[torch.Tensor, dict[str, Any], bool]:
    model = load(path, pack_path=pack, arena_bytes=arena, config=BASE, progress=False)
    try:
        engine = model.strata_engine
        ids = torch.tensor([[1, 5, 9, 2, 7, 3, 11, 4]])
        with torch.no_grad():
            logits = model(ids).logits
            out = model.generate(ids, max_new_tokens=6, do_sample=False)
        stats = engine.window.stats()["total"]
        both = torch.cat([logits.flatten(), out.flatten().to(logits.dtype)])
        return both, stats, engine.filled_at_load
    finally:
        model.strata_engine.close()


def test_an_arena_of_every_expert_is_filled_at_load(checkpoint: tuple[Path, Path]) -> None:
    path, pack = checkpoint
    with ExpertPack.open(pack) as p:
        every = p.geometry.n_records * p.record_stride
        small = 2 * p.geometry.top_k * p.record_stride
    full, full_stats, filled = _logits_and_stats(path, pack, every)
    assert filled
    assert full_stats["misses"] == 0 and full_stats["hits"] > 0
    assert full_stats["pred_predicted"] == 0  # every layer resident for good: no next router
    part, part_stats, part_filled = _logits_and_stats(path, pack, small)
    assert not part_filled
    assert part_stats["misses"] > 0 and part_stats["pred_predicted"] > 0
    assert torch.equal(full, part)  # the same bits at every arena size
