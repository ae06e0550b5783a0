"""lm-eval itself against the server, offline, as a new user runs it: `local-completions` on a
small local multiple-choice task (log-likelihoods: token-id prompts, echo, logprobs) and a
generate_until task. lm-eval is in the `test` extra (`lm-eval[api]`: its API models need
aiohttp and tenacity), so CI runs this; skipped where it is not installed.

The oracles: each choice's log-likelihood and is-greedy flag from plain mlx-lm's log-softmax on
the tokens lm-eval sends (its own split of context and continuation: the whole string encoded,
the context's tokens first), and the generated text from plain mlx-lm's greedy generate."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from serve.harness import serving
from serve.helpers import MODEL_ID, Served, scrape

lm_eval = pytest.importorskip("lm_eval")

MC = [
    {"question": "the water is", "choices": ["hot", "cold word", "model"], "answer": 0},
    {"question": "you can", "choices": ["write", "read the", "stream"], "answer": 1},
    {"question": "hello", "choices": ["world", "arena", "token"], "answer": 0},
]
GEN = [{"question": "the water is hot", "answer": "x"}, {"question": "hello world", "answer": "y"}]


def many_mc(n: int) -> list[dict[str, Any]]:
    """n multiple-choice rows built from the chat checkpoint's words (ordered, so the same n
    gives the same rows)."""
    words = ["the", "water", "is", "hot", "model", "arena", "token", "stream", "read", "write"]
    return [
        {"question": f"{words[i % 10]} {words[(3 * i + 1) % 10]} {words[(7 * i + 2) % 10]}",
         "choices": [words[(i + 4) % 10], f"{words[(i + 5) % 10]} {words[i % 10]}",
                     words[(i + 6) % 10]],
         "answer": i % 3}
        for i in range(n)
    ]  # fmt: skip


def task_files(root: Path, mc: list[dict[str, Any]] = MC, gen: list[dict[str, Any]] = GEN) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name, rows, body in (
        ("mc", mc, 'output_type: multiple_choice\ndoc_to_choice: "{{choices}}"\n'
                   "metric_list:\n  - metric: acc\n"),
        ("gen", gen, "output_type: generate_until\ngeneration_kwargs:\n"
                     '  until: ["<eos>"]\n  max_gen_toks: 6\n'
                     "metric_list:\n  - metric: exact_match\n"),
    ):  # fmt: skip
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (root / f"tiny_{name}.yaml").write_text(
            f"task: tiny_{name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {data}\ntest_split: test\n"
            'doc_to_text: "{{question}}"\ndoc_to_target: "{{answer}}"\n' + body
        )
    return root


def run_lm_eval(
    url: str, tiny_path: Path, tasks_root: Path, model_args: str, mc: list[dict[str, Any]],
    gen: list[dict[str, Any]], tokenizer: Any, oracle: Callable[[list[int], int], str],
    reference: Callable[[list[int]], np.ndarray], batch_size: int | None = None,
) -> None:  # fmt: skip
    """lm-eval's local-completions on both tasks against the server at `url`, every answer
    checked against plain mlx-lm."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    # Only the test's own tasks are indexed: lm-eval's built-in task configs (thousands of YAML
    # files, read on every TaskManager) play no part in how it talks to the server.
    tasks = TaskManager(include_path=str(task_files(tasks_root, mc, gen)), include_defaults=False)
    args = (f"model={MODEL_ID},base_url={url}/v1/completions,tokenizer_backend=huggingface,"
            f"tokenizer={tiny_path},{model_args}")  # fmt: skip
    out = simple_evaluate(model="local-completions", model_args=args, batch_size=batch_size,
                          tasks=["tiny_mc", "tiny_gen"], task_manager=tasks,
                          log_samples=True)  # fmt: skip
    assert out is not None
    samples = out["samples"]["tiny_mc"]
    assert len(samples) == len(mc)
    for sample in samples:
        assert len(sample["resps"]) == len(sample["doc"]["choices"])
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"],
                                                 strict=True):  # fmt: skip
            whole = [int(t) for t in tokenizer.encode(context + continuation)]
            start = len(tokenizer.encode(context))
            want = reference(whole)
            loglikelihood, greedy = resp[0]
            assert float(loglikelihood) == pytest.approx(
                sum(want[t - 1, whole[t]] for t in range(start, len(whole))), abs=1e-3
            )
            assert greedy == all(int(want[t - 1].argmax()) == whole[t]
                                 for t in range(start, len(whole)))  # fmt: skip
    scores = out["results"]["tiny_mc"]["acc,none"]
    picked = {s["doc"]["question"]: max(range(len(s["resps"])),
                                        key=lambda i, s=s: float(s["resps"][i][0][0]))
              for s in samples}  # fmt: skip
    assert scores == pytest.approx(np.mean([picked[row["question"]] == row["answer"]
                                            for row in mc]))  # fmt: skip
    generated = out["samples"]["tiny_gen"]
    assert len(generated) == len(gen)
    for sample in generated:
        ids = [int(t) for t in tokenizer.encode(sample["doc"]["question"])]
        assert sample["resps"][0][0] == oracle(ids, 6)  # greedy, as plain mlx-lm writes it


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_lm_eval_runs_both_kinds_of_task_unchanged(
    served: Served,
    tiny_path: Path,
    tmp_path: Path,
    tokenizer: Any,
    oracle: Callable[[list[int], int], str],
    reference: Callable[[list[int]], np.ndarray],
    offline: None,
) -> None:
    run_lm_eval(served.url, tiny_path, tmp_path / "tasks", "num_concurrent=2,max_retries=1",
                MC, GEN, tokenizer, oracle, reference)  # fmt: skip


def test_lm_eval_concurrent_and_batched_against_a_default_server(
    tiny_path: Path,
    tmp_path: Path,
    tokenizer: Any,
    oracle: Callable[[list[int], int], str],
    reference: Callable[[list[int]], np.ndarray],
    offline: None,
) -> None:
    """The command line docs/serve.md gives (num_concurrent=16, --batch_size 4: 16 requests of
    4 prompts at once) against a server with every default: each request is one queue place,
    so none is refused (max_retries=1: a 503 would fail the run)."""
    import mlx_lm

    model, tok = mlx_lm.load(str(tiny_path))
    gen = [{"question": row["question"], "answer": "x"} for row in many_mc(16)]
    mc = many_mc(40)
    with serving(model, tok) as server:
        run_lm_eval(server.url, tiny_path, tmp_path / "tasks", "num_concurrent=16,max_retries=1",
                    mc, gen, tokenizer, oracle, reference, batch_size=4)  # fmt: skip
        answered = scrape(server.url)['strata_serve_requests_total{route="/v1/completions",'
                                      'status="200"}']  # fmt: skip
    # Batched: each request carried up to 4 of the 3 x 40 log-likelihoods and 16 generations.
    assert answered < (3 * len(mc) + len(gen)) / 2
