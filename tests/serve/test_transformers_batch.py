"""`serve --engine transformers` batches: several clients at once, each one's text (greedy, and
sampled with a seed) bitwise its answer alone, tokens and log-probabilities, with the experts
streamed (serve/transformers_continuous.py). The oracle for the text is plain transformers'
own `generate` per prompt (AutoModelForCausalLM on the same float32 checkpoint, eager experts);
the bitwise oracle is the same server answering each client alone. Cancelling one client, or
one client's bad request, leaves the others' answers as alone."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from serve.harness import family, hf_tokenizer, quarter_streamed, serving  # noqa: E402
from serve.helpers import TIMEOUT_S, client_for, scrape, together  # noqa: E402
from strata_stream.serve import ServeConfig  # noqa: E402
from strata_stream.serve.transformers_continuous import LayerMeeting  # noqa: E402

if TYPE_CHECKING:
    from test_transformers_families import Family

MODEL_ID = "tiny-hf-qwen3-moe"
CHUNK = 16  # prefill chunk: the longer prompts are read over several steps, beside decodes
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def fam(tmp_path_factory: pytest.TempPathFactory) -> Family:
    """The checkpoint with its own tokenizer (make_checkpoint's, not the tool tokenizer)."""
    return family(tmp_path_factory.mktemp("serve_hf_batch"))


@pytest.fixture(scope="module")
def prompts(fam: Family) -> list[list[int]]:
    """Six prompts of different lengths (3 to 70 tokens: up to five prefill chunks)."""
    rng = np.random.default_rng(375)
    return [[int(t) for t in rng.integers(3, 60, n)] for n in (3, 7, 19, 33, 50, 70)]


@pytest.fixture(scope="module")
def server(fam: Family) -> Iterator[str]:
    """The streamed model at a quarter of its experts, batching up to 8."""
    model = quarter_streamed(fam)
    config = ServeConfig(model_id=MODEL_ID, prefill_chunk=CHUNK, max_batch=8,
                         stats_interval_s=0.05)  # fmt: skip
    with serving(model, hf_tokenizer(fam), config, engine="transformers",
                 close_engine=True) as s:  # fmt: skip
        yield s.url


def greedy_ids(fam: Family, prompt: list[int], n: int) -> list[int]:
    """Plain transformers' greedy tokens after `prompt`, up to n or its EOS (left out)."""
    with torch.no_grad():
        out = fam.ref.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    new = [int(t) for t in out[0, len(prompt) :]]
    return new[: new.index(1)] if 1 in new else new  # 1 is <eos>


def answer(url: str, prompt: list[int], **kw: Any) -> tuple[str, Any, str | None]:
    """(text, token log-probabilities and their top 2, finish reason) of one completion."""
    r = client_for(url).completions.create(model=MODEL_ID, prompt=prompt, max_tokens=MAX_TOKENS,
                                           logprobs=2, **kw)  # fmt: skip
    c = r.choices[0]
    assert c.logprobs is not None
    return c.text, (c.logprobs.token_logprobs, c.logprobs.top_logprobs), c.finish_reason


def batched_steps(url: str) -> float:
    """Steps that sampled for more than one sequence so far."""
    m = scrape(url)
    return m["strata_serve_batch_size_count"] - m['strata_serve_batch_size_bucket{le="1.0"}']


def test_clients_together_get_their_alone_answers_and_plain_transformers_text(
    fam: Family, prompts: list[list[int]], server: str
) -> None:
    tokenizer = hf_tokenizer(fam)
    alone = [answer(server, p, temperature=0) for p in prompts]
    for p, (text, _, _) in zip(prompts, alone, strict=True):
        assert text == tokenizer.decode(greedy_ids(fam, p, MAX_TOKENS))
    before = batched_steps(server)
    assert together([lambda p=p: answer(server, p, temperature=0) for p in prompts]) == alone
    assert batched_steps(server) > before  # they did share steps


def test_seeded_sampling_does_not_depend_on_the_batch(
    prompts: list[list[int]], server: str
) -> None:
    kw = [{"temperature": 1.3, "seed": 10 + i, "top_p": 0.95} for i in range(len(prompts))]
    alone = [answer(server, p, **k) for p, k in zip(prompts, kw, strict=True)]
    assert len({a[0] for a in alone}) > 1
    got = together([lambda p=p, k=k: answer(server, p, **k)
                    for p, k in zip(prompts, kw, strict=True)])  # fmt: skip
    assert got == alone


def test_a_cancelled_client_leaves_the_others_as_alone(
    prompts: list[list[int]], server: str
) -> None:
    others = prompts[:4]
    alone = [answer(server, p, temperature=0) for p in others]
    client = client_for(server)

    def hang_up() -> int:
        stream = client.completions.create(model=MODEL_ID, prompt=prompts[5], max_tokens=200,
                                           temperature=0, stream=True)  # fmt: skip
        n = 0
        for _ in stream:
            n += 1
            if n == 3:
                stream.close()  # the client goes away mid-answer
                break
        return n

    got = together([hang_up, *[lambda p=p: answer(server, p, temperature=0) for p in others]])
    assert got[0] == 3 and got[1:] == alone


def test_a_bad_request_among_clients_harms_none(
    fam: Family, prompts: list[list[int]], server: str
) -> None:
    alone = [answer(server, p, temperature=0) for p in prompts[:4]]
    vocab = int(fam.ref.config.vocab_size)

    def bad() -> str:
        with pytest.raises(openai.BadRequestError) as e:
            client_for(server).completions.create(
                model=MODEL_ID, prompt=prompts[0], max_tokens=4, extra_body={"top_k": vocab}
            )
        return str(e.value)

    got = together([bad, *[lambda p=p: answer(server, p, temperature=0) for p in prompts[:4]]])
    assert "top_k" in got[0] and got[1:] == alone


def test_a_pass_that_fails_in_the_batch_fails_alone(
    fam: Family, prompts: list[list[int]], server: str
) -> None:
    """A request whose own forward pass fails (its token id passes the server's check against
    a vocabulary the config claims wider than the embedding) ends with an error while the
    clients batched with it get their answers alone: its pass leaves the layers' meeting."""
    alone = [answer(server, p, temperature=0) for p in prompts[:4]]
    model = quarter_streamed(fam)
    real = int(model.config.vocab_size)
    model.config.vocab_size = real + 8
    config = ServeConfig(model_id=MODEL_ID, prefill_chunk=CHUNK, max_batch=8)
    with serving(model, hf_tokenizer(fam), config, engine="transformers",
                 close_engine=True) as s:  # fmt: skip

        def bad() -> str:
            with pytest.raises(openai.InternalServerError) as e:
                answer(s.url, [*prompts[2], real + 3], temperature=0)
            return str(e.value)

        good = [lambda p=p: answer(s.url, p, temperature=0) for p in prompts[:4]]
        got = together([*good[:2], bad, *good[2:]])
        assert got[:2] + got[3:] == alone
        assert "index" in got[2].lower()
        # The engine still serves a whole batch afterwards.
        assert together(good) == alone


# ---- the meeting of a step's passes -----------------------------------------------------------


def _rows_times_layer(layer: int, x: Any, ids: Any, weights: Any) -> Any:
    return x * (layer + 1) + ids.sum(-1, keepdim=True) * weights.sum(-1, keepdim=True)


def _meet(meeting: LayerMeeting, inputs: list[Any], fail: int | None = None) -> list[Any]:
    out: list[Any] = [None] * len(inputs)

    def run(i: int) -> None:
        try:
            for layer in range(3):
                if i == fail and layer == 1:
                    raise ValueError("this pass fails alone")
                x, ids, w = inputs[i]
                out[i] = meeting.run(layer, x, ids, w)
        except BaseException as e:
            out[i] = e
        finally:
            meeting.leave()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    meeting.serve()  # on this thread, as the worker's
    for t in threads:
        t.join(TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), "a pass waits for ever"
    return out


def test_the_meeting_gives_each_pass_its_own_rows_in_one_call_per_layer() -> None:
    g = torch.Generator().manual_seed(3)
    inputs = [(torch.randn(1, n, 4, generator=g), torch.randint(0, 8, (n, 2), generator=g),
               torch.rand(n, 2, generator=g)) for n in (1, 5, 2)]  # fmt: skip
    calls: list[tuple[int, int]] = []

    def run_rows(layer: int, x: Any, ids: Any, weights: Any) -> Any:
        calls.append((int(x.shape[0]), threading.get_ident()))
        return _rows_times_layer(layer, x, ids, weights)

    out = _meet(LayerMeeting(run_rows, len(inputs)), inputs)
    # Every layer: one call of all rows, on the serving thread (a Window's turn is one thread's).
    assert calls == [(8, threading.get_ident())] * 3
    for (x, ids, w), got in zip(inputs, out, strict=True):
        assert torch.equal(got, _rows_times_layer(2, x[0], ids, w).reshape(x.shape))


def test_a_pass_that_fails_leaves_and_the_others_go_on() -> None:
    inputs = [(torch.ones(1, n, 4), torch.ones(n, 2, dtype=torch.long), torch.ones(n, 2))
              for n in (1, 2, 3)]  # fmt: skip
    out = _meet(LayerMeeting(_rows_times_layer, len(inputs)), inputs, fail=1)
    assert isinstance(out[1], ValueError)
    assert all(isinstance(out[i], torch.Tensor) for i in (0, 2))


def test_an_engine_error_reaches_every_pass_of_the_step() -> None:
    def broken(layer: int, x: Any, ids: Any, weights: Any) -> Any:
        raise OSError("layer 0 expert 3: checksum mismatch")

    inputs = [(torch.ones(1, 1, 4), torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2))] * 3
    out = _meet(LayerMeeting(broken, len(inputs)), inputs)
    assert all(isinstance(o, OSError) for o in out)
