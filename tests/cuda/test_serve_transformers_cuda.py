"""`serve --engine transformers --device cuda`: the server over a model loaded with
strata_stream.transformers.load(device="cuda") (the dense layers in torch on the GPU, the
experts on the CUDA backend) answers with the text the same model's `generate` gives, and its
/metrics carry the engine's figures. On the H200 (`-m cuda`); deselected elsewhere."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("fastapi")
pytest.importorskip("openai")

from serve.helpers import TIMEOUT_S, client_for, scrape, wait_until  # noqa: E402
from strata_stream.config import StreamConfig  # noqa: E402
from strata_stream.convert import convert  # noqa: E402
from strata_stream.serve import BackgroundServer, ServeConfig, create_app  # noqa: E402
from strata_stream.transformers import load, stats_source  # noqa: E402
from strata_stream.transformers.random_model import make_checkpoint  # noqa: E402

pytestmark = pytest.mark.cuda


def test_serving_on_cuda_answers_with_generates_text(tmp_path: Path) -> None:
    path = make_checkpoint("qwen3_moe", tmp_path / "model")
    pack = convert(path, tmp_path / "experts.strpk", progress=False)
    config = StreamConfig(io_threads=2, direct_io=False, persist_profile=False)

    def streamed() -> object:
        return load(path, pack_path=pack, device="cuda", dtype=torch.float32, config=config,
                    attn_implementation="eager", progress=False)  # fmt: skip

    served, own = streamed(), streamed()
    try:
        tok = transformers.AutoTokenizer.from_pretrained(path)
        ids = tok.encode("w30 w31 w7")
        with torch.no_grad():
            out = own.generate(torch.tensor([ids], device="cuda"), max_new_tokens=12,  # type: ignore[attr-defined]
                               do_sample=False)  # fmt: skip
        new = [int(t) for t in out[0, len(ids) :]]
        new = new[: new.index(1)] if 1 in new else new  # 1 is <eos>
        app = create_app(served, tok, ServeConfig(model_id="m", stats_interval_s=0.05),
                         stats=stats_source(served))  # fmt: skip
        with BackgroundServer(app, timeout_s=TIMEOUT_S) as server:
            r = client_for(server.url).completions.create(model="m", prompt=ids, max_tokens=12,
                                                          temperature=0)  # fmt: skip
            assert r.choices[0].text == tok.decode(new)
            wait_until(lambda: scrape(server.url).get("strata_expert_hits_total", 0) > 0,
                       "the engine's hits in /metrics")  # fmt: skip
    finally:
        for m in (served, own):
            m.strata_engine.close()  # type: ignore[attr-defined]
