"""Tasks: determinism by index, held-out evaluation prompts disjoint from training, datasets, errors."""

from __future__ import annotations

import json

import pytest

from miles.config import ConfigError
from miles.config.rollout import TaskConfig
from miles.rollout.tasks import build_task


def test_digits_deterministic_and_correct() -> None:
    task = build_task(TaskConfig(name="digits", options={"op": "last", "num_digits": 3}), seed=1)
    a, b = task.train_prompt(5), task.train_prompt(5)
    assert a == b
    assert a.answer == str(a.metadata["digits"][-1]) and a.text.endswith(
        " ".join(map(str, a.metadata["digits"]))
    )
    seed1 = [build_task(TaskConfig(), 1).train_prompt(i).text for i in range(20)]
    assert seed1 != [build_task(TaskConfig(), 2).train_prompt(i).text for i in range(20)]


def test_digits_eval_disjoint_from_training() -> None:
    task = build_task(TaskConfig(name="digits", options={"num_digits": 4}, eval_size=32), seed=0)
    held_out = {p.text for p in task.eval_prompts()}
    assert len(task.eval_prompts()) == 32
    assert not held_out & {task.train_prompt(i).text for i in range(5000)}


def test_digits_bad_option() -> None:
    with pytest.raises(ConfigError, match="op"):
        build_task(TaskConfig(name="digits", options={"op": "divide"}), seed=0)
    with pytest.raises(ConfigError, match="unknown option"):
        build_task(TaskConfig(name="digits", options={"digits": 3}), seed=0)


def test_jsonl_dataset_holds_out_rows(tmp_path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"q": f"question {i}", "a": str(i)}) + "\n" for i in range(20)))
    task = build_task(
        TaskConfig(name="jsonl", path=str(path), prompt_key="q", answer_key="a", eval_size=5), 0
    )
    evals = {p.text for p in task.eval_prompts()}
    train = {task.train_prompt(i).text for i in range(15)}
    assert len(evals) == 5 and len(train) == 15 and not evals & train
    assert task.train_prompt(15).text in train  # second epoch cycles over the same rows


def test_parquet_dataset(tmp_path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": [f"p{i}" for i in range(8)], "answer": list(range(8))}), path)
    task = build_task(TaskConfig(name="jsonl", path=str(path), eval_size=2), 0)
    assert len(task.eval_prompts()) == 2 and task.train_prompt(0).text.startswith("p")


def test_dataset_errors_name_keys(tmp_path) -> None:
    with pytest.raises(ConfigError, match="rollout.task.path"):
        build_task(TaskConfig(name="jsonl"), 0)
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"x": 1}) + "\n")
    with pytest.raises(ConfigError, match="prompt_key"):
        build_task(TaskConfig(name="jsonl", path=str(path), eval_size=0), 0)


def test_reasoning_gym_task() -> None:
    task = build_task(
        TaskConfig(name="reasoning_gym", options={"dataset": "basic_arithmetic", "size": 50}, eval_size=4), 0
    )
    p = task.train_prompt(3)
    assert p.text and p.metadata["entry"]["answer"] == p.answer
    assert len(task.eval_prompts()) == 4


def test_unknown_task_lists_known() -> None:
    with pytest.raises(ConfigError, match="digits"):
        build_task(TaskConfig(name="nope"), 0)


def test_longtail_lengths_are_heavy_tailed() -> None:
    task = build_task(
        TaskConfig(name="longtail", options={"min_tokens": 4, "max_tokens": 256, "alpha": 1.0}), 0
    )
    lengths = [task.train_prompt(i).metadata["sampling"]["max_new_tokens"] for i in range(2000)]
    assert min(lengths) >= 4 and max(lengths) <= 256
    lengths.sort()
    median, p99 = lengths[1000], lengths[1980]
    assert median <= 10 and p99 >= 200  # Pareto(1): median 2 x min, a long tail up to the cap


def test_random_tokens_fixed_shapes_and_deterministic() -> None:
    cfg = TaskConfig(
        name="random_tokens", options={"prompt_tokens": 128, "response_tokens": 512, "high": 1000}
    )
    task = build_task(cfg, seed=3)
    a, b = task.train_prompt(7), build_task(cfg, seed=3).train_prompt(7)
    assert a.metadata["input_ids"] == b.metadata["input_ids"]
    assert len(a.metadata["input_ids"]) == 128 and all(0 <= t < 1000 for t in a.metadata["input_ids"])
    assert a.metadata["sampling"] == {"max_new_tokens": 512, "ignore_eos": True, "stop_token_ids": []}
    assert task.train_prompt(8).metadata["input_ids"] != a.metadata["input_ids"]
    assert {p.index for p in task.eval_prompts()}.isdisjoint(range(1000))
    with pytest.raises(ConfigError, match="low < high"):
        build_task(TaskConfig(name="random_tokens", options={"low": 5, "high": 5}), seed=0)
