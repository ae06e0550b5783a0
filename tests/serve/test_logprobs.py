"""What evaluators need (lm-eval's local-completions): several token-id prompts per request,
echo with max_tokens 0 or 1 for prompt log-probabilities, logprobs/top_logprobs on completions
and chat as the OpenAI API defines them; and every bad parameter a 400 naming it.

The oracle is plain mlx-lm on its own copy of the model: log-softmax of its logits in float64
(numpy), teacher-forced on the prompt and on the served tokens (conftest's `reference`)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from serve.helpers import MODEL_ID, Served, post_json

PROMPT = "the water is hot and you can write"


def completions(served: Served, **body: Any) -> dict[str, Any]:
    status, answer = post_json(served.url + "/v1/completions",
                               json.dumps({"model": MODEL_ID, **body}).encode())  # fmt: skip
    assert status == 200, answer
    return answer


def test_several_token_prompts_get_one_choice_each(served: Served, tokenizer: Any) -> None:
    a = [int(t) for t in tokenizer.encode("hello world")]
    b = [int(t) for t in tokenizer.encode(PROMPT)]
    alone = [completions(served, prompt=p, max_tokens=8, temperature=0)["choices"][0]["text"]
             for p in (a, b)]  # fmt: skip
    both = completions(served, prompt=[a, b], max_tokens=8, temperature=0)
    assert [c["index"] for c in both["choices"]] == [0, 1]
    assert [c["text"] for c in both["choices"]] == alone
    assert alone[0] != alone[1]
    assert both["usage"]["prompt_tokens"] == len(a) + len(b)
    assert both["usage"]["completion_tokens"] == 16


def test_echo_with_no_tokens_scores_the_prompt(
    served: Served, tokenizer: Any, reference: Any
) -> None:
    ids = [int(t) for t in tokenizer.encode(PROMPT)]
    r = completions(served, prompt=[ids], max_tokens=0, echo=True, logprobs=2, temperature=0)
    choice = r["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == tokenizer.decode(ids)
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None
    assert lp["top_logprobs"][0] is None
    want = reference(ids)
    for t in range(1, len(ids)):
        assert lp["token_logprobs"][t] == pytest.approx(want[t - 1, ids[t]], abs=1e-4)
        top = lp["top_logprobs"][t]
        assert len(top) <= 2 and max(top.values()) == pytest.approx(want[t - 1].max(), abs=1e-4)
    assert r["usage"]["completion_tokens"] == 0


def test_lm_eval_loglikelihood_payload(served: Served, tokenizer: Any, reference: Any) -> None:
    """lm-eval 0.4's request (echo, max_tokens 1, logprobs 1) and its parse_logprobs: the sum of
    token_logprobs[ctxlen:-1] and whether every continuation token was the greedy one."""
    context = [int(t) for t in tokenizer.encode("the water is")]
    cont = [int(t) for t in tokenizer.encode("hot and you")]
    ids = context + cont
    r = completions(served, prompt=[ids], max_tokens=1, echo=True, logprobs=1, temperature=0,
                    seed=1234)  # fmt: skip
    lp = r["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + 1  # the prompt, then the one sampled token
    ctxlen = len(context)
    total = sum(lp["token_logprobs"][ctxlen:-1])
    want = reference(ids)
    assert total == pytest.approx(sum(want[t - 1, ids[t]] for t in range(ctxlen, len(ids))),
                                  abs=1e-3)  # fmt: skip
    pairs = zip(lp["token_logprobs"][ctxlen:-1], lp["top_logprobs"][ctxlen:-1], strict=True)
    greedy = all(tok == max(top.values()) for tok, top in pairs)
    assert greedy == all(int(want[t - 1].argmax()) == ids[t] for t in range(ctxlen, len(ids)))
    # The sampled token is greedy (temperature 0): its logprob is its row's top.
    assert lp["token_logprobs"][-1] == max(lp["top_logprobs"][-1].values())


def test_completion_logprobs_of_sampled_tokens(
    served: Served, tokenizer: Any, reference: Any
) -> None:
    ids = [int(t) for t in tokenizer.encode(PROMPT)]
    r = completions(served, prompt=ids, max_tokens=6, logprobs=3, temperature=0)
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 6 and all(len(t) == 3 for t in lp["top_logprobs"])
    assert lp["text_offset"][0] == 0
    # Teacher-forced on the served tokens (word-level tokenizer: one word per token).
    served_ids = [int(t) for t in tokenizer.encode(r["choices"][0]["text"])]
    assert len(served_ids) == 6
    want = reference(ids + served_ids)
    decisive = 0
    for i, t in enumerate(served_ids):
        row = want[len(ids) - 1 + i]
        top2 = np.sort(row)[-2:]
        # Greedy wherever the reference is decisive: a cached decode step and this one
        # full-sequence forward round differently in bfloat16, so a near tie may go either way.
        if top2[1] - top2[0] > 0.1:
            decisive += 1
            assert int(row.argmax()) == t
        # The model's logits are bfloat16: mlx-lm's BatchGenerator normalises them in it.
        assert lp["token_logprobs"][i] == pytest.approx(row[t], abs=0.1)
        assert lp["token_logprobs"][i] == max(lp["top_logprobs"][i].values())
    assert decisive >= 2, "too few decisive positions to check greedy decoding"


def test_chat_logprobs_and_top_logprobs(served: Served) -> None:
    msgs: Any = [{"role": "user", "content": PROMPT}]
    r = served.client.chat.completions.create(
        model=MODEL_ID, messages=msgs, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 5
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].token == item.token  # greedy
        assert item.top_logprobs[0].logprob == item.logprob
        assert item.bytes == list(item.token.encode())
    streamed = served.client.chat.completions.create(
        model=MODEL_ID, messages=msgs, max_tokens=5, temperature=0, logprobs=True, stream=True
    )
    tokens = [i.token for c in streamed if c.choices and c.choices[0].logprobs
              for i in (c.choices[0].logprobs.content or [])]  # fmt: skip
    assert tokens == [i.token for i in content]
    plain = served.client.chat.completions.create(
        model=MODEL_ID, messages=msgs, max_tokens=5, temperature=0
    )
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("chat", b'{"model": "M", "messages": MSG, "seed": 123456789012345678901234567890}',
         "seed"),
        ("chat", b'{"model": "M", "messages": MSG, "temperature": NaN}', "temperature"),
        ("chat", b'{"model": "M", "messages": MSG, "top_p": Infinity}', "top_p"),
        ("chat", b'{"model": "M", "messages": MSG, "top_logprobs": 2}', "top_logprobs"),
        ("chat", b'{"model": "M", "messages": MSG, "logprobs": true, "top_logprobs": 21}',
         "top_logprobs"),
        ("cmpl", b'{"model": "M", "prompt": "hello", "max_tokens": 0}', "max_tokens"),
        ("cmpl", b'{"model": "M", "prompt": "hello", "logprobs": -1}', "logprobs"),
        ("cmpl", b'{"model": "M", "prompt": [[5, 6], [7]], "stream": true}', "prompt"),
        ("cmpl", b'{"model": "M", "prompt": []}', "prompt"),
        ("cmpl", b'{"model": "M", "prompt": "hello", "echo": true, "stream": true}', "echo"),
    ],
)  # fmt: skip
def test_each_bad_parameter_is_a_400_naming_it(
    served: Served, route: str, body: bytes, param: str
) -> None:
    url = served.url + ("/v1/chat/completions" if route == "chat" else "/v1/completions")
    raw = body.replace(b'"M"', json.dumps(MODEL_ID).encode()).replace(
        b"MSG", b'[{"role": "user", "content": "hello"}]'
    )
    status, answer = post_json(url, raw)
    assert status == 400, answer
    assert answer["error"]["param"] == param, answer
    assert param in answer["error"]["message"]
