"""`strata-stream serve --engine transformers`: the OpenAI server over a transformers model
whose experts stream (strata_stream.transformers.load), through the real `openai` client.

The oracle is plain transformers (`AutoModelForCausalLM.from_pretrained` on the same float32
checkpoint, eager experts): its greedy `generate` tokens and its log-softmax, teacher-forced.
The streamed float32 model agrees with it within 1e-5 of max|logit|
(tests/test_transformers_families.py), so greedy text must be equal and log-probabilities close.
The served model runs at a quarter of its experts, so they stream and /metrics has reads to
show. Sampling and the logits processors are checked against mlx-lm's own definitions.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from serve.helpers import TIMEOUT_S, client_for, scrape, wait_until  # noqa: E402
from strata_stream.pack.reader import ExpertPack  # noqa: E402
from strata_stream.serve import BackgroundServer, ServeConfig, create_app  # noqa: E402
from strata_stream.serve.generation import SamplingParams  # noqa: E402
from strata_stream.serve.loader import load_for_serving  # noqa: E402
from strata_stream.serve.torch_sampling import TorchSampler, make_processors  # noqa: E402
from strata_stream.transformers import load, stats_source  # noqa: E402
from test_transformers_families import BASE, Family  # noqa: E402

MODEL_ID = "tiny-hf-qwen3-moe"
# A template the WordLevel tokenizer can read (its words are w0..w59): the turns' contents.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
PROMPTS = ["w44 w13", "w30 w31 w7", "w9 w9 w40 w41 w2 w3", "w50 w6"]


@pytest.fixture(scope="module")
def fam(tmp_path_factory: pytest.TempPathFactory) -> Family:
    f = Family("qwen3_moe", tmp_path_factory.mktemp("serve_hf"), "float32")
    tok = transformers.AutoTokenizer.from_pretrained(f.path)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(f.path)
    return f


@pytest.fixture(scope="module")
def tokenizer(fam: Family) -> Any:
    return transformers.AutoTokenizer.from_pretrained(fam.path)


@pytest.fixture(scope="module")
def server(fam: Family, tokenizer: Any) -> Iterator[tuple[str, Any]]:
    """The streamed model at a quarter of its experts, served on a free loopback port."""
    model = fam.load(slots=fam.n_records // 4)
    try:
        app = create_app(model, tokenizer, ServeConfig(model_id=MODEL_ID, stats_interval_s=0.05),
                         stats=stats_source(model))  # fmt: skip
        with BackgroundServer(app, timeout_s=TIMEOUT_S) as s:
            yield s.url, model
    finally:
        model.strata_engine.close()


def greedy_ids(fam: Family, prompt: list[int], n: int) -> list[int]:
    """Plain transformers' greedy tokens after `prompt`, up to n or its EOS (left out)."""
    with torch.no_grad():
        out = fam.ref.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    new = [int(t) for t in out[0, len(prompt) :]]
    return new[: new.index(1)] if 1 in new else new  # 1 is <eos>


def ref_logprobs(fam: Family, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = fam.ref(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, dim=-1).numpy()


def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def health(url: str) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(url + "/health", timeout=TIMEOUT_S) as r:
            return dict(json.loads(r.read()))
    except urllib.error.HTTPError as e:
        return dict(json.loads(e.read()))
    except urllib.error.URLError:  # not accepting yet: uvicorn starts after the model loads
        return {}


def test_completions_and_chat_are_plain_transformers_greedy_text(
    fam: Family, tokenizer: Any, server: tuple[str, Any]
) -> None:
    client = client_for(server[0])
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        want_ids = greedy_ids(fam, ids, 16)
        want = tokenizer.decode(want_ids)
        assert len(want.split()) >= 8  # real text to compare (the tiny model's vocabulary is
        # wider than its tokenizer's: ids past it decode to nothing)
        r = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=16, temperature=0)
        assert r.choices[0].text == want, prompt
        assert r.usage is not None and r.usage.prompt_tokens == len(ids)
        assert r.usage.completion_tokens == len(want_ids)
        assert r.choices[0].finish_reason == ("length" if len(want_ids) == 16 else "stop")
    msgs = [{"role": "user", "content": "w3 w9 w11"}]
    ids = tokenizer.encode(tokenizer.apply_chat_template(msgs, add_generation_prompt=True,
                                                         tokenize=False))  # fmt: skip
    want_ids = greedy_ids(fam, ids, 12)
    assert len(tokenizer.decode(want_ids).split()) > 5
    r = client.chat.completions.create(model=MODEL_ID, messages=msgs, max_tokens=12,  # type: ignore[arg-type]
                                       temperature=0)  # fmt: skip
    assert r.choices[0].message.content == tokenizer.decode(want_ids)
    assert r.usage is not None and r.usage.prompt_tokens == len(ids)


def test_streaming_equals_the_whole_answer(server: tuple[str, Any]) -> None:
    client = client_for(server[0])
    msgs = [{"role": "user", "content": "w3 w9 w11"}]
    whole = client.chat.completions.create(model=MODEL_ID, messages=msgs, max_tokens=12,  # type: ignore[arg-type]
                                           temperature=0).choices[0].message.content  # fmt: skip
    chunks = list(client.chat.completions.create(
        model=MODEL_ID, messages=msgs, max_tokens=12, temperature=0, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True},
    ))  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 1
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL_ID, prompt=PROMPTS[0], max_tokens=10, temperature=0, stream=True))  # fmt: skip
    assert text == client.completions.create(
        model=MODEL_ID, prompt=PROMPTS[0], max_tokens=10, temperature=0).choices[0].text


def test_logprobs_and_echo_match_plain_transformers(
    fam: Family, tokenizer: Any, server: tuple[str, Any]
) -> None:
    url = server[0] + "/v1/completions"
    ids = tokenizer.encode(PROMPTS[2])
    status, r = post(url, {"model": MODEL_ID, "prompt": ids, "max_tokens": 0, "echo": True,
                           "logprobs": 2, "temperature": 0})  # fmt: skip
    assert status == 200, r
    lp = r["choices"][0]["logprobs"]
    assert r["choices"][0]["text"] == tokenizer.decode(ids)
    assert lp["token_logprobs"][0] is None and len(lp["tokens"]) == len(ids)
    want = ref_logprobs(fam, ids)
    for t in range(1, len(ids)):
        assert lp["token_logprobs"][t] == pytest.approx(want[t - 1, ids[t]], abs=1e-4)
        assert max(lp["top_logprobs"][t].values()) == pytest.approx(want[t - 1].max(), abs=1e-4)
    # Sampled (greedy) tokens: each one's logprob is its row's top one, exactly, and the value
    # plain transformers gives it teacher-forced.
    status, r = post(url, {"model": MODEL_ID, "prompt": ids, "max_tokens": 6, "logprobs": 3,
                           "temperature": 0})  # fmt: skip
    assert status == 200, r
    lp = r["choices"][0]["logprobs"]
    new = greedy_ids(fam, ids, 6)
    assert len(lp["tokens"]) == len(new) > 0
    want = ref_logprobs(fam, ids + new)
    for i, tok in enumerate(new):
        assert lp["token_logprobs"][i] == max(lp["top_logprobs"][i].values())
        assert lp["token_logprobs"][i] == pytest.approx(want[len(ids) - 1 + i, tok], abs=1e-4)
        assert len(lp["top_logprobs"][i]) == 3


def test_seeded_sampling_repeats_and_differs_from_greedy(server: tuple[str, Any]) -> None:
    client = client_for(server[0])

    def sample(seed: int) -> str:
        r = client.completions.create(model=MODEL_ID, prompt=PROMPTS[1], max_tokens=16,
                                      temperature=1.5, seed=seed)  # fmt: skip
        return str(r.choices[0].text)

    runs = {seed: sample(seed) for seed in (1, 2, 3)}
    assert sample(2) == runs[2]
    greedy = client.completions.create(model=MODEL_ID, prompt=PROMPTS[1], max_tokens=16,
                                       temperature=0).choices[0].text  # fmt: skip
    assert any(text != greedy for text in runs.values())


def test_clients_at_once_each_answered_as_alone(server: tuple[str, Any]) -> None:
    url = server[0]
    client = client_for(url)

    def complete(prompt: str) -> str:
        return str(client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=10,
                                              temperature=0).choices[0].text)  # fmt: skip

    alone = {p: complete(p) for p in PROMPTS}
    results: dict[str, str] = {}
    threads = [threading.Thread(target=lambda p=p: results.__setitem__(p, complete(p)))
               for p in PROMPTS]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    assert results == alone  # batched (tests/serve/test_transformers_batch.py), bitwise alone
    assert health(url)["max_batch"] == 8


def test_metrics_and_health_report_the_engine(fam: Family, server: tuple[str, Any]) -> None:
    url, model = server
    client_for(url).completions.create(model=MODEL_ID, prompt=PROMPTS[3], max_tokens=8)
    wait_until(lambda: scrape(url).get("strata_expert_misses_total", 0) > 0, "misses in /metrics")
    m = scrape(url)
    slots = model.strata_engine.stream.n_slots
    assert slots == fam.n_records // 4
    assert m["strata_arena_slots"] == slots and 0 < m["strata_arena_slots_in_use"] <= slots
    assert m["strata_expert_bytes_read_total"] >= fam.stride * m["strata_expert_misses_total"]
    assert 0 <= m["strata_expert_hit_rate"] < 1  # a quarter arena: not everything hits
    assert m["strata_expert_routed_total"] > 0
    assert m["strata_serve_generated_tokens_total"] > 0
    body = health(url)
    assert body["status"] == "ok" and body["errors"]["count"] == 0


def test_bad_sampling_fields_are_400s_that_never_reach_the_engine(
    server: tuple[str, Any],
) -> None:
    """Each was a 500 from inside the model's sampling (a repetition penalty of 1e-300 makes
    every logit infinite) and counted against /health; now refused naming the field."""
    url, model = server
    vocab = int(model.config.vocab_size)
    for fields, param in (
        ({"repetition_penalty": 1e-300}, "repetition_penalty"),
        ({"repetition_penalty": 1e300}, "repetition_penalty"),
        ({"seed": -1}, "seed"),
        ({"top_k": vocab}, "top_k"),
        ({"top_k": 2**70}, "top_k"),
    ):
        status, body = post(url + "/v1/completions", {"model": MODEL_ID, "prompt": PROMPTS[0],
                                                      "temperature": 1.0, **fields})  # fmt: skip
        assert status == 400 and body["error"]["param"] == param, body
    status, body = post(url + "/v1/chat/completions", {
        "model": MODEL_ID, "messages": [{"role": "user", "content": "w1 \ud800"}]})  # fmt: skip
    assert status == 400 and body["error"]["param"] == "messages.0.content", body
    body = health(url)
    assert body["status"] == "ok" and body["errors"]["count"] == 0


def test_a_damaged_pack_fails_requests_naming_it_and_health_degrades(
    fam: Family, tokenizer: Any, tmp_path: Path
) -> None:
    import shutil

    pack = Path(shutil.copy(fam.pack, tmp_path / "damaged.strpk"))
    with ExpertPack.open(pack) as p:
        first, end = p.records_offset, p.file_bytes
    model = load(fam.path, pack_path=pack, arena_bytes=2 * fam.top_k * fam.stride, config=BASE,
                 dtype=torch.float32, progress=False)  # fmt: skip
    try:
        fd = os.open(pack, os.O_WRONLY)
        try:  # every record's bytes now disagree with its checksum
            os.pwrite(fd, b"\x5a" * (end - first), first)
        finally:
            os.close(fd)
        app = create_app(model, tokenizer, ServeConfig(model_id=MODEL_ID),
                         stats=stats_source(model))  # fmt: skip
        with BackgroundServer(app, timeout_s=TIMEOUT_S) as s:
            client = client_for(s.url)
            for _ in range(2):
                with pytest.raises(openai.InternalServerError) as e:
                    client.completions.create(model=MODEL_ID, prompt=PROMPTS[0], max_tokens=4)
                assert "layer" in str(e.value) and "expert" in str(e.value)
            body = health(s.url)
    finally:
        model.strata_engine.close()
    assert body["status"] == "degraded" and body["errors"]["count"] == 2
    assert body["errors"]["failing"] and "layer" in body["errors"]["last"]


def test_the_loader_serves_transformers(fam: Family) -> None:
    loaded = load_for_serving(str(fam.path), pack_path=fam.pack, engine="transformers",
                              arena_bytes=fam.n_records * fam.stride)  # fmt: skip
    try:
        assert loaded.engine == "transformers"
        assert loaded.model.strata_pack_path == fam.pack
        assert loaded.stats()["slots_total"] == fam.n_records
        assert loaded.tokenizer.chat_template == CHAT_TEMPLATE
    finally:
        loaded.model.strata_engine.close()


def test_cli_serves_with_the_transformers_engine(
    fam: Family, tokenizer: Any, tmp_path: Path
) -> None:
    """The real command in a subprocess: it prints its address, answers like plain
    transformers, and stops on SIGTERM."""
    cmd = [sys.executable, "-m", "strata_stream.cli", "serve", str(fam.path), "--engine",
           "transformers", "--device", "cpu", "--port", "0", "--pack", str(fam.pack),
           "--arena-gb", str(fam.n_records * fam.stride / 2**30),
           "--model-id", MODEL_ID]  # fmt: skip
    env = {**os.environ, "STRATA_DIRECT_IO": "0", "STRATA_CACHE": str(tmp_path)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)  # fmt: skip
    try:
        assert proc.stdout is not None
        line = ""
        for _ in range(200):
            line = proc.stdout.readline()
            if "listening on" in line or not line:
                break
        assert "listening on http://" in line, line
        url = line.split("listening on ")[1].strip()
        wait_until(lambda: health(url).get("status") == "ok", "the model to load")
        ids = tokenizer.encode(PROMPTS[0])
        r = client_for(url).completions.create(model=MODEL_ID, prompt=PROMPTS[0], max_tokens=8,
                                               temperature=0)  # fmt: skip
        assert r.choices[0].text == tokenizer.decode(greedy_ids(fam, ids, 8))
        assert health(url)["max_batch"] == 8
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    # uvicorn shuts down gracefully, then re-raises the signal it caught.
    rest = proc.stdout.read() if proc.stdout is not None else ""
    assert proc.returncode == -signal.SIGTERM, rest
    assert "Finished server process" in rest, rest


@pytest.mark.parametrize("extra", [
    ["--engine", "transformers", "--max-batch", "0"],
    ["--engine", "transformers", "--device", "tpu"],
    ["--engine", "transformers", "--tensor"],
    ["--engine", "mlx-lm", "--device", "cuda"],
])  # fmt: skip
def test_cli_mistakes_are_one_line_errors(
    fam: Family, extra: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from strata_stream.cli import main

    capsys.readouterr()
    assert main(["serve", str(fam.path), "--port", "0", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("strata-stream: error:"), err
    if extra[1] == "transformers":  # and generate's --device is checked the same way
        assert main(["generate", str(fam.path), "--prompt", "w1", *extra[:2], "--device",
                     "tpu"]) == 2  # fmt: skip
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "--device" in err


def test_help_says_how_the_engine_is_chosen(capsys: pytest.CaptureFixture[str]) -> None:
    from strata_stream.cli import main

    for command in ("serve", "generate"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "Without --engine: mlx-lm where mlx-lm is installed, else transformers" in text
        assert "cuda" in text


# ---- sampling: the same definitions as mlx-lm's -----------------------------------------------


def test_sampling_filters_and_processors_are_mlx_lms() -> None:
    mx = pytest.importorskip("mlx.core")
    su = pytest.importorskip("mlx_lm.sample_utils")
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(50).astype(np.float32) * 3
    tokens = [int(t) for t in rng.integers(0, 50, 30)]
    for kw in ({"repetition_penalty": 1.3}, {"presence_penalty": 0.7},
               {"frequency_penalty": 0.4}):  # fmt: skip
        mine = torch.tensor(logits)
        for p in make_processors(SamplingParams(**kw)):  # type: ignore[arg-type]
            mine = p(tokens, mine)
        theirs = mx.array(logits)[None]
        for p in su.make_logits_processors(**kw):
            theirs = p(mx.array(tokens), theirs)
        np.testing.assert_allclose(mine.numpy(), np.array(theirs)[0], rtol=1e-6, atol=1e-6)
    lp = torch.log_softmax(torch.tensor(logits), 0)
    from strata_stream.serve import torch_sampling as ts

    for mine, theirs in (
        (ts._top_p(lp, 0.8), su.apply_top_p(mx.array(lp.numpy()), 0.8)),
        (ts._min_p(lp, 0.1), su.apply_min_p(mx.array(lp.numpy()), 0.1)),
        (ts._top_k(lp, 7), su.apply_top_k(mx.array(lp.numpy()), 7)),
    ):
        assert np.array_equal(np.isinf(mine.numpy()), np.isinf(np.array(theirs)))
    greedy = TorchSampler(SamplingParams(temperature=0))
    assert greedy(lp) == int(torch.argmax(lp))
    seeded = [TorchSampler(SamplingParams(temperature=1.0, top_k=5, seed=7)) for _ in range(2)]
    draws = [[s(lp) for _ in range(20)] for s in seeded]
    assert draws[0] == draws[1]
    assert set(draws[0]) <= set(torch.topk(lp, 5).indices.tolist())


# ---- streaming text ---------------------------------------------------------------------------


def _byte_level_tokenizer() -> Any:
    """A byte-level BPE with no merges: every UTF-8 byte its own token, so one character of
    several bytes spans several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE({c: i for i, c in enumerate(sorted(alphabet))}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.mark.parametrize("text", ["plain words, and more.", "héllo wörld ✓ 日本語 🙂 end"])
def test_streamed_segments_add_up_to_the_decoded_text(text: str) -> None:
    from strata_stream.serve.hf_tokenizer import StreamingDetokenizer

    tok = _byte_level_tokenizer()
    ids = tok.encode(text)
    assert len(ids) == len(text.encode())  # one token a byte
    detok = StreamingDetokenizer(tok)
    segments = []
    for t in ids:
        detok.add_token(t)
        segments.append(detok.last_segment)
    detok.finalize()
    segments.append(detok.last_segment)
    assert "".join(segments) == tok.decode(ids) == text
    assert not any("\ufffd" in s for s in segments)  # a character is sent whole, once complete
    assert sum(1 for s in segments if s) > 10  # and the text streamed, not all at the end
