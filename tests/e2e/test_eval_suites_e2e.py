"""Two named eval datasets with different sampling on a real embedded engine serving a tiny model:
the metrics land in metrics.jsonl and TensorBoard through the run's metrics logger, and every sample
in RUN_DIR/eval/<name>/step_<N>.jsonl; a dataset the engine refuses is reported without hiding the
other; and `miles train` with two datasets records both at each evaluated step."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from pathlib import Path

import pytest
from conftest import finish, miles_train

from miles.config import Plan
from miles.engine.process import start_engine
from miles.eval.datasets import EvalSuite, aime_synthetic_rows, build_suites, write_jsonl
from miles.eval.metrics import pass_at_k
from miles.eval.shared import evaluate_suites
from miles.metrics import MetricsLogger, read_metrics
from miles.rollout.client import SGLangClient
from miles.rollout.generate import Generator, PromptEncoder
from miles.rollout.rewards import first_number, load_reward
from miles.rollout.tasks import Prompt

pytestmark = pytest.mark.slow

VERSION = 3
"""The weight version the engine serves during the evaluations (set by a reload from disk)."""


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    with start_engine(
        tiny_model, device="cpu", log_path=tmp_path_factory.mktemp("eng") / "engine.log"
    ) as eng:
        yield eng


def make_plan(tiny_model: str, aime_file: Path) -> Plan:
    return Plan.model_validate(
        {
            "model": {"path": tiny_model},
            "rollout": {
                "task": {"name": "digits", "options": {"num_digits": 1}, "eval_size": 5},
                "reward": "miles.rollout.rewards:first_number",
                "max_new_tokens": 16,
            },
            "eval": {
                "datasets": {
                    # sampled: 4 samples at temperature 1, 3 new tokens at most
                    "digits": {"source": "digits", "options": {"num_digits": 2}, "size": 4, "samples": 4}
                    | {"temperature": 1.0, "max_new_tokens": 3},
                    # greedy: 2 samples at temperature 0, 6 new tokens at most, boxed-answer scorer
                    "aime": {"source": "aime", "path": str(aime_file), "samples": 2, "temperature": 0.0}
                    | {"max_new_tokens": 6},
                }
            },
        }
    )


def generator(engine, tiny_model: str, plan: Plan) -> Generator:
    client = SGLangClient(engine.url)
    return Generator.from_config(
        [client], PromptEncoder(tiny_model), load_reward(plan.rollout.reward), plan.rollout
    )


async def evaluate_at(gen: Generator, suites: list[EvalSuite], step: int, out_dir: Path) -> dict[str, float]:
    """Reload the same weights as version VERSION, then evaluate."""
    model_path = gen.encoder.tokenizer.name_or_path
    await gen.clients[0].update_weights_from_disk(model_path, weight_version=str(VERSION))
    try:
        return await evaluate_suites(gen, suites, step, out_dir)
    finally:
        await gen.clients[0].aclose()


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_two_datasets_with_their_own_sampling(engine, tiny_model, tmp_path) -> None:
    aime_file = write_jsonl(aime_synthetic_rows(3, seed=1), tmp_path / "aime_2024.jsonl")
    plan = make_plan(tiny_model, aime_file)
    run_dir = tmp_path / "run"
    suites = build_suites(plan)
    metrics = asyncio.run(evaluate_at(generator(engine, tiny_model, plan), suites, 7, run_dir / "eval"))
    logger = MetricsLogger(run_dir, tensorboard=True)
    logger.log(7, metrics)
    logger.close()

    [row] = read_metrics(run_dir)
    assert row["step"] == 7
    digits = read_jsonl(run_dir / "eval" / "digits" / "step_7.jsonl")
    aime = read_jsonl(run_dir / "eval" / "aime" / "step_7.jsonl")
    assert len(digits) == 4 * 4 and len(aime) == 3 * 2
    assert not [p for p in (run_dir / "eval").rglob("*") if p.name.endswith(".tmp")]

    for records, cap in ((digits, 3), (aime, 6)):
        assert all(0 < r["response_tokens"] <= cap and r["prompt_tokens"] > 0 for r in records)
        assert all(r["weight_versions"] == [VERSION] and r["step"] == 7 for r in records)
        assert all(r["finish_reason"] in ("stop", "length") for r in records)
    # each dataset sampled its own way: greedy samples of one prompt agree, sampled ones differ somewhere
    by_prompt = defaultdict(set)
    for r in aime:
        by_prompt[r["prompt_index"]].add(r["output"])
    assert all(len(outputs) == 1 for outputs in by_prompt.values())
    by_prompt = defaultdict(set)
    for r in digits:
        by_prompt[r["prompt_index"]].add(r["output"])
    assert any(len(outputs) > 1 for outputs in by_prompt.values())

    # scores are the datasets' scorers, and the logged metrics follow from the records
    assert all(r["score"] == first_number(_as_sample(r)) for r in digits)
    assert [r["id"] for r in aime[::2]] == [row["id"] for row in aime_synthetic_rows(3, seed=1)]
    assert all(
        "\\boxed{}" in r["prompt"] and r["score"] == 0.0 for r in aime
    )  # an untrained model boxes nothing
    for name, records, n in (("digits", digits, 4), ("aime", aime, 2)):
        counts = defaultdict(int)
        for r in records:
            counts[r["prompt_index"]] += r["correct"]
        assert row[f"eval/{name}/mean@{n}"] == pytest.approx(
            sum(c / n for c in counts.values()) / len(counts)
        )
        assert row[f"eval/{name}/pass@2"] == pytest.approx(
            sum(pass_at_k(n, c, 2) for c in counts.values()) / len(counts)
        )
        length = sum(r["finish_reason"] == "length" for r in records) / len(records)
        assert row[f"eval/{name}/truncated_frac"] == pytest.approx(length)
        mean_len = sum(r["response_tokens"] for r in records) / len(records)
        assert row[f"eval/{name}/response_len_mean"] == pytest.approx(mean_len)
        assert row[f"eval/{name}/weight_version_min"] == row[f"eval/{name}/weight_version_max"] == VERSION
    assert "eval/digits/pass@4" in row and "eval/aime/pass@4" not in row
    assert row["eval/pass@1"] == pytest.approx((row["eval/digits/pass@1"] + row["eval/aime/pass@1"]) / 2)
    assert row["eval/weight_version_min"] == row["eval/weight_version_max"] == VERSION

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    [point] = events.Scalars("eval/digits/mean@4")
    assert point.step == 7 and point.value == pytest.approx(row["eval/digits/mean@4"])
    assert "eval/aime/pass@2" in events.Tags()["scalars"]


def _as_sample(record: dict):
    from miles.sample import Sample

    return Sample(0, 0, [], response=record["output"], answer=record["answer"])


def test_a_refused_dataset_is_reported_and_the_other_still_counts(engine, tiny_model, tmp_path) -> None:
    plan = make_plan(tiny_model, write_jsonl(aime_synthetic_rows(2), tmp_path / "a.jsonl"))
    digits = build_suites(plan)[0]
    # token ids outside the vocabulary: the engine answers 400 to every request of this dataset
    broken = EvalSuite("broken", [Prompt(0, "bad", "1", {"input_ids": [10**8]})], 2, {"max_new_tokens": 2})
    metrics = asyncio.run(
        evaluate_at(generator(engine, tiny_model, plan), [digits, broken], 2, tmp_path / "eval")
    )
    assert metrics["eval/broken/failed"] == 1.0 and "eval/digits/mean@4" in metrics
    assert "eval/broken/mean@2" not in metrics and metrics["eval/failed_requests"] == 0
    [record, _] = read_jsonl(tmp_path / "eval" / "broken" / "step_2.jsonl")
    assert record["finish_reason"] == "failed" and "400" in record["error"]

    with pytest.raises(RuntimeError, match="every dataset failed"):
        asyncio.run(evaluate_at(generator(engine, tiny_model, plan), [broken], 3, tmp_path / "eval"))


def test_miles_train_evaluates_each_dataset_at_its_step(recipe) -> None:
    path, run_dir = recipe(
        rollout={"schedule": "sync"},
        train={"steps": 2},
        eval={
            "every_steps": 2,
            "datasets": {
                "digits": {
                    "source": "digits",
                    "size": 3,
                    "samples": 4,
                    "temperature": 1.0,
                    "max_new_tokens": 3,
                },
                "aime": {"source": "aime_synthetic", "size": 2, "samples": 2, "temperature": 0.0}
                | {"max_new_tokens": 4},
            },
        },
    )
    finish(miles_train(str(path)))
    evals = [r for r in read_metrics(run_dir) if "eval/digits/mean@4" in r]
    assert [r["step"] for r in evals] == [0, 2]
    for r in evals:
        assert "eval/aime/mean@2" in r and "eval/aime/pass@2" in r and "eval/digits/pass@4" in r
        assert r["eval/digits/weight_version_min"] == r["eval/aime/weight_version_max"] == r["step"]
        for name, n in (("digits", 3 * 4), ("aime", 2 * 2)):
            records = read_jsonl(run_dir / "eval" / name / f"step_{r['step']}.jsonl")
            assert len(records) == n and all(x["weight_versions"] == [r["step"]] for x in records)
            assert r[f"eval/{name}/response_len_mean"] == pytest.approx(
                sum(x["response_tokens"] for x in records) / n
            )
