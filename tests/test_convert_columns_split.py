"""The gate/up split of a fused gate_up_proj [E, H, 2I]: names and shapes cannot tell gpt-oss's
interleaved columns from openai_privacy_filter's gate columns then up columns, so the converter
takes it from the experts module transformers builds for the checkpoint (is_concatenated).

The checkpoint is openai_privacy_filter's token-classification model, built tiny by the
coverage matrix's builder (tests/model_coverage/transformers_matrix.py) from transformers' own
classes, and streamed against plain transformers on the same directory.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.model_coverage.transformers_matrix import PROMPT, TOLERANCE, build_tiny  # noqa: E402

from strata_stream import ExpertPack, StreamConfig  # noqa: E402
from strata_stream.convert import checkpoint, convert  # noqa: E402
from strata_stream.convert.safetensors_index import SafetensorsIndex  # noqa: E402
from strata_stream.errors import ConfigError  # noqa: E402
from strata_stream.transformers import load  # noqa: E402

MODEL_TYPE = "openai_privacy_filter"
BASE = StreamConfig(io_threads=2, direct_io=False, persist_profile=False)


@pytest.fixture(scope="module")
def privacy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """(checkpoint, the Auto class its model is built as) of a tiny float32 model."""
    path = tmp_path_factory.mktemp("columns_split") / MODEL_TYPE
    built = build_tiny(MODEL_TYPE, path)
    assert built.moe and built.auto is not None
    return path, built.auto


@torch.no_grad()
def logits(model: Any) -> np.ndarray:
    out: np.ndarray = model(torch.tensor([PROMPT])).logits[0].float().numpy()
    return out


def streamed(path: Path, auto: Any, pack: Path) -> Any:
    with ExpertPack.open(pack) as p:
        arena = (2 * p.geometry.top_k + 1) * p.record_stride
    return load(
        path, pack_path=pack, arena_bytes=arena, config=BASE, dtype=torch.float32,
        attn_implementation="eager", progress=False, model_class=auto,
    )  # fmt: skip


def test_the_split_is_the_experts_modules_and_streams_exactly(
    privacy: tuple[Path, Any], tmp_path: Path
) -> None:
    path, auto = privacy
    pack = convert(path, tmp_path / "p.strpk", progress=False)
    with ExpertPack.open(pack) as p:
        model_block = p.metadata["model"]
    assert model_block["layout"] == "fused_columns_halves"
    assert "columns_split_assumed" not in model_block
    ref_model = auto.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager",
        experts_implementation="eager",
    ).eval()  # fmt: skip
    ref = logits(ref_model)
    del ref_model
    model = streamed(path, auto, pack)
    try:
        got = logits(model)
    finally:
        model.strata_engine.close()
    scale = float(np.abs(ref).max())
    assert float(np.abs(got - ref).max()) <= TOLERANCE * scale


def test_the_callers_split_wins(privacy: tuple[Path, Any]) -> None:
    path, _ = privacy
    with SafetensorsIndex(path) as index:
        told = checkpoint.find_experts(path, index, columns_split="interleaved")
        read = checkpoint.find_experts(path, index)
        with pytest.raises(ConfigError, match="columns_split"):
            checkpoint.find_experts(path, index, columns_split="rows")  # type: ignore[arg-type]
    assert told.model["layout"] == "fused_columns"
    assert read.model["layout"] == "fused_columns_halves"


def test_an_assumed_split_the_model_contradicts_is_refused_with_how_to_reconvert(
    privacy: tuple[Path, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, auto = privacy
    # As a convert where transformers cannot build the model: the split is assumed, and said.
    monkeypatch.setattr(checkpoint, "declared_columns_split", lambda model_dir: None)
    pack = convert(path, tmp_path / "assumed.strpk", progress=False)
    with ExpertPack.open(pack) as p:
        model_block = p.metadata["model"]
    assert model_block["layout"] == "fused_columns"
    assert model_block["columns_split_assumed"] is True
    with pytest.raises(ConfigError) as e:
        streamed(path, auto, pack)
    msg = str(e.value)
    assert "\n" not in msg
    assert "is_concatenated=True" in msg and "strata-stream convert" in msg
