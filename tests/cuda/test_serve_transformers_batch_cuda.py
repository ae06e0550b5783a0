"""`serve --engine transformers --device cuda` batches (serve/transformers_continuous.py):
clients of different prompt lengths served at once each get their answer alone, bitwise (tokens
and log-probabilities, greedy and seeded), and the greedy text is the same model's `generate`.
On the GPU machine (`-m cuda`); deselected elsewhere."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("fastapi")
pytest.importorskip("openai")

from serve.helpers import TIMEOUT_S, client_for, scrape  # noqa: E402
from strata_stream.config import StreamConfig  # noqa: E402
from strata_stream.convert import convert  # noqa: E402
from strata_stream.pack.reader import ExpertPack  # noqa: E402
from strata_stream.serve import BackgroundServer, ServeConfig, create_app  # noqa: E402
from strata_stream.transformers import load  # noqa: E402
from strata_stream.transformers.random_model import make_checkpoint  # noqa: E402

pytestmark = pytest.mark.cuda


def test_clients_batched_on_cuda_get_their_alone_answers(tmp_path: Path) -> None:
    path = make_checkpoint("qwen3_moe", tmp_path / "model")
    pack = convert(path, tmp_path / "experts.strpk", progress=False)
    with ExpertPack.open(pack) as p:
        quarter = (p.geometry.n_records // 4) * p.record_stride
    config = StreamConfig(io_threads=2, direct_io=False, persist_profile=False)

    def streamed() -> Any:
        return load(path, pack_path=pack, device="cuda", dtype=torch.float32, config=config,
                    arena_bytes=quarter, attn_implementation="eager", progress=False)  # fmt: skip

    served, own = streamed(), streamed()
    try:
        tok = transformers.AutoTokenizer.from_pretrained(path)
        rng = np.random.default_rng(5)
        prompts = [[int(t) for t in rng.integers(3, 60, n)] for n in (3, 9, 21, 40, 66)]
        app = create_app(served, tok, ServeConfig(model_id="m", max_batch=8, prefill_chunk=16),
                         engine="transformers")  # fmt: skip
        with BackgroundServer(app, timeout_s=TIMEOUT_S) as server:
            client = client_for(server.url)

            def answer(i: int, **kw: Any) -> Any:
                r = client.completions.create(model="m", prompt=prompts[i], max_tokens=10,
                                              logprobs=2, **kw)  # fmt: skip
                c = r.choices[0]
                return c.text, c.logprobs.token_logprobs, c.logprobs.top_logprobs

            for kw in ({"temperature": 0}, {"temperature": 1.2, "seed": 4}):
                alone = [answer(i, **kw) for i in range(len(prompts))]
                got: list[Any] = [None] * len(prompts)

                def run(i: int, got: list[Any] = got, kw: dict[str, Any] = kw) -> None:
                    got[i] = answer(i, **kw)

                threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(TIMEOUT_S)
                assert got == alone, kw
            m = scrape(server.url)  # some steps sampled for several sequences
            single = m['strata_serve_batch_size_bucket{le="1.0"}']
            assert m["strata_serve_batch_size_count"] > single
            for i, ids in enumerate(prompts):
                with torch.no_grad():
                    out = own.generate(torch.tensor([ids], device="cuda"), max_new_tokens=10,
                                       do_sample=False)  # fmt: skip
                new = [int(t) for t in out[0, len(ids) :]]
                new = new[: new.index(1)] if 1 in new else new  # 1 is <eos>
                assert answer(i, temperature=0)[0] == tok.decode(new), i
    finally:
        for m in (served, own):
            m.strata_engine.close()
