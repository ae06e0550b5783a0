"""lm-eval itself against the server, offline, as a new user runs it: `local-completions` on a
small local multiple-choice task (log-likelihoods: token-id prompts, echo, logprobs) and a
generate_until task. Skipped where lm-eval is not installed (it is no dependency of ours)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from serve.helpers import MODEL_ID, Served

lm_eval = pytest.importorskip("lm_eval")

MC = [
    {"question": "the water is", "choices": ["hot", "cold word", "model"], "answer": 0},
    {"question": "you can", "choices": ["write", "read the", "stream"], "answer": 1},
    {"question": "hello", "choices": ["world", "arena", "token"], "answer": 0},
]
GEN = [{"question": "the water is hot", "answer": "x"}, {"question": "hello world", "answer": "y"}]


def task_files(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name, rows, body in (
        ("mc", MC, 'output_type: multiple_choice\ndoc_to_choice: "{{choices}}"\n'
                   "metric_list:\n  - metric: acc\n"),
        ("gen", GEN, "output_type: generate_until\ngeneration_kwargs:\n"
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


def test_lm_eval_runs_both_kinds_of_task_unchanged(
    served: Served,
    tiny_path: Path,
    tmp_path: Path,
    tokenizer: Any,
    oracle: Callable[[list[int], int], str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tasks = TaskManager(include_path=str(task_files(tmp_path / "tasks")))
    args = (f"model={MODEL_ID},base_url={served.url}/v1/completions,tokenizer_backend=huggingface,"
            f"tokenizer={tiny_path},num_concurrent=2,max_retries=1")  # fmt: skip
    out = simple_evaluate(model="local-completions", model_args=args,
                          tasks=["tiny_mc", "tiny_gen"], task_manager=tasks,
                          log_samples=True)  # fmt: skip
    assert out is not None
    mc = out["samples"]["tiny_mc"]
    assert len(mc) == len(MC)
    for sample in mc:
        scores = [float(r[0][0]) for r in sample["resps"]]
        assert all(s < 0 for s in scores)  # real log-likelihoods, one per choice
        assert len(set(scores)) == len(scores)
    gen = out["samples"]["tiny_gen"]
    assert len(gen) == len(GEN)
    for sample in gen:
        ids = [int(t) for t in tokenizer.encode(sample["doc"]["question"])]
        assert sample["resps"][0][0] == oracle(ids, 6)  # greedy, as plain mlx-lm writes it
