"""`strata_stream.transformers.load(..., model_class=...)`: a checkpoint whose model is no text
generator (a multimodal model's text sub-config, which transformers builds only as its text
model) streams as the class the caller names, against plain transformers' same class on the
same directory; a class transformers cannot build from the config is one line.

The checkpoint is qwen3_vl_moe_text's text model, built tiny by the coverage matrix's builder
(tests/model_coverage/transformers_matrix.py) from transformers' own classes.
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

from tests.model_coverage.transformers_matrix import PROMPT, TOLERANCE, tiny_config  # noqa: E402

from strata_stream import ExpertPack, StreamConfig  # noqa: E402
from strata_stream.convert import convert  # noqa: E402
from strata_stream.errors import ConfigError  # noqa: E402
from strata_stream.transformers import load  # noqa: E402
from strata_stream.transformers.random_model import randomize  # noqa: E402

MODEL_TYPE = "qwen3_vl_moe_text"
BASE = StreamConfig(io_threads=2, direct_io=False, persist_profile=False)


@pytest.fixture(scope="module")
def text_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(checkpoint, pack) of a tiny random float32 text model with no generation class."""
    root = tmp_path_factory.mktemp("model_class")
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(tiny_config(MODEL_TYPE), dtype=torch.float32)
    randomize(model, 0)
    model.config.dtype = "float32"
    path = root / MODEL_TYPE
    model.save_pretrained(str(path))
    return path, convert(path, root / f"{MODEL_TYPE}.strpk", progress=False)


@torch.no_grad()
def hidden(model: Any) -> np.ndarray:
    out: np.ndarray = model(torch.tensor([PROMPT])).last_hidden_state[0].float().numpy()
    return out


def test_the_default_class_is_refused_with_how_to_pass_one(text_model: tuple[Path, Path]) -> None:
    path, pack = text_model
    with pytest.raises(ConfigError) as e:
        load(path, pack_path=pack, config=BASE, progress=False)
    msg = str(e.value)
    assert "\n" not in msg
    assert MODEL_TYPE in msg and "model_class=" in msg and "AutoModel" in msg


@pytest.mark.parametrize("how", ["auto", "class"])
def test_a_text_model_streams_as_the_class_named(text_model: tuple[Path, Path], how: str) -> None:
    """AutoModel (resolved as transformers resolves it) or the model class itself: the same
    streamed experts, the last hidden state within the float32 tolerance of plain transformers'
    at an arena well below the experts' size."""
    path, pack = text_model
    plain = transformers.AutoModel.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    cls = type(plain)
    want = hidden(plain)
    del plain
    with ExpertPack.open(pack) as p:
        arena = (2 * p.geometry.top_k + 1) * p.record_stride
        assert arena < p.geometry.n_layers * p.geometry.n_experts * p.record_stride
    named = transformers.AutoModel if how == "auto" else cls
    model = load(
        path, pack_path=pack, arena_bytes=arena, config=BASE, dtype=torch.float32,
        attn_implementation="eager", progress=False, model_class=named,
    )  # fmt: skip
    try:
        assert isinstance(model, cls)
        got = hidden(model)
        stats = model.strata_engine.window.stats()
    finally:
        model.strata_engine.close()
    diff = float(np.abs(got - want).max())
    assert diff <= TOLERANCE * float(np.abs(want).max()), diff
    assert stats["total"]["bytes_read"] > 0  # the experts came from the pack, through the arena


@pytest.mark.parametrize(
    ("model_class", "says"),
    [
        ("AutoModelForCausalLM", "model_class AutoModelForCausalLM: transformers maps no class for "
                                 "Qwen3VLMoeTextConfig (model type qwen3_vl_moe_text)"),
        ("MixtralModel", "model_class MixtralModel: transformers cannot build it from "
                         "Qwen3VLMoeTextConfig (model type qwen3_vl_moe_text; it takes "
                         "MixtralConfig)"),
        ("Linear", "model_class Linear: not a transformers model class or Auto class (model type "
                   "qwen3_vl_moe_text)"),
        ("a string", "model_class 'AutoModel': not a transformers model class or Auto class"),
    ],
    ids=["auto-class-mapping-nothing", "class-of-another-config", "not-a-model", "a-string"],
)  # fmt: skip
def test_a_class_transformers_cannot_build_is_one_line(
    text_model: tuple[Path, Path], model_class: str, says: str
) -> None:
    path, pack = text_model
    cls: Any = {"Linear": torch.nn.Linear, "a string": "AutoModel"}.get(model_class)
    if cls is None:
        cls = getattr(transformers, model_class)
    with pytest.raises(ConfigError) as e:
        load(path, pack_path=pack, config=BASE, progress=False, model_class=cls)
    msg = str(e.value)
    assert "\n" not in msg
    assert says in msg
