"""Evaluation datasets: the generated AIME-format set, AIME files in the common layouts, and
eval.datasets -> suites (inheritance, defaults by source, backwards-compatible default)."""

from __future__ import annotations

import json
import math
import re

import pytest
from pydantic import ValidationError

from miles.config import ConfigError, Plan
from miles.eval import scoring
from miles.eval.datasets import (
    BOXED_INSTRUCTION,
    aime_synthetic_rows,
    build_suites,
    load_aime,
    write_jsonl,
)
from miles.rollout import rewards
from miles.rollout.tasks import build_task


def recompute(problem: str) -> int:
    """The answer of a generated problem, worked out again from its text alone."""
    nums = [int(x) for x in re.findall(r"\d+", problem)]
    if problem.startswith("Find the remainder when $\\binom"):
        return math.comb(nums[0], nums[1]) % 1000
    if problem.startswith("Find the remainder when"):
        return pow(nums[0], nums[1], nums[2])
    if problem.startswith("How many positive integers divide"):
        return sum(nums[0] % d == 0 for d in range(1, nums[0] + 1))
    if problem.startswith("Real numbers"):
        total, product = nums[0], nums[1]  # "x + y = total and xy = product. Find x^2 + y^2"
        return total * total - 2 * product
    if problem.startswith("Find the number of ordered pairs"):
        n = nums[-2]
        return sum(math.gcd(a, n - a) == 1 for a in range(1, n))
    raise AssertionError(f"unknown template: {problem}")


def test_synthetic_aime_is_deterministic_and_correct() -> None:
    rows = aime_synthetic_rows(40, seed=3)
    assert rows == aime_synthetic_rows(40, seed=3) and rows != aime_synthetic_rows(40, seed=4)
    assert all(set(r) == {"id", "problem", "answer"} for r in rows)  # the AIME layout
    assert len({r["id"] for r in rows}) == 40 and len({r["problem"] for r in rows}) == 40
    assert all(re.fullmatch(r"\d{1,3}", r["answer"]) for r in rows)
    assert any(len(r["answer"]) == 3 and r["answer"].startswith("0") for r in rows)  # answer-key style
    for r in rows:
        assert recompute(r["problem"]) == int(r["answer"]), r


LAYOUTS = {
    # HuggingFaceH4/aime_2024 (id int, answer str), math-ai/aime25 (id str)
    "h4": lambda i, p, a: {
        "id": i,
        "problem": p,
        "solution": "...",
        "answer": str(a),
        "url": "",
        "year": "2024",
    },
    "maxwell": lambda i, p, a: {"ID": f"2024-I-{i}", "Problem": p, "Solution": "...", "Answer": a},
    "matharena": lambda i, p, a: {"problem_idx": i, "problem": p, "answer": a},
    "opencompass": lambda i, p, a: {"question": p, "answer": str(a)},
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_aime_files_of_the_common_layouts_load(tmp_path, layout: str) -> None:
    rows = [LAYOUTS[layout](i + 1, f"Problem {i}", a) for i, a in enumerate([204, 25, 809])]
    path = write_jsonl(rows, tmp_path / "aime.jsonl")
    prompts = load_aime(str(path))
    assert [p.text for p in prompts] == ["Problem 0", "Problem 1", "Problem 2"]
    assert [int(p.answer) for p in prompts] == [204, 25, 809]
    ids = [p.metadata["id"] for p in prompts]
    assert ids == ([0, 1, 2] if layout == "opencompass" else [rows[i][next(iter(rows[i]))] for i in range(3)])


def test_aime_parquet_and_explicit_keys(tmp_path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "aime.parquet"
    pq.write_table(pa.Table.from_pylist([{"q": "P", "gold": "033", "pid": "x"}]), path)
    [p] = load_aime(str(path), prompt_key="q", answer_key="gold", id_key="pid")
    assert (p.text, p.answer, p.metadata["id"]) == ("P", "033", "x")


def test_aime_file_errors_name_the_key(tmp_path) -> None:
    path = write_jsonl([{"text": "P", "answer": "1"}], tmp_path / "a.jsonl")
    with pytest.raises(ConfigError, match=r"eval\.datasets\.a24\.prompt_key"):
        load_aime(str(path), cfg_key="eval.datasets.a24")
    with pytest.raises(ConfigError, match=r"eval\.datasets\.a24\.answer_key"):
        load_aime(str(path), prompt_key="text", answer_key="gold", cfg_key="eval.datasets.a24")
    with pytest.raises(ConfigError, match=r"eval\.datasets\.a24\.id_key"):
        load_aime(str(path), prompt_key="text", id_key="pid", cfg_key="eval.datasets.a24")
    with pytest.raises(ConfigError, match=r"eval\.datasets\.a24\.path='.*missing.jsonl' does not exist"):
        load_aime(str(tmp_path / "missing.jsonl"), cfg_key="eval.datasets.a24")


def plan(**eval_section) -> Plan:
    return Plan.model_validate(
        {
            "rollout": {
                "task": {"name": "digits", "options": {"num_digits": 2}, "eval_size": 6},
                "reward": "miles.rollout.rewards:first_number",
                "temperature": 1.0,
                "top_p": 0.9,
                "max_new_tokens": 5,
                "group_requests": True,
            },
            "eval": {"samples_per_prompt": 3, "temperature": 0.6, **eval_section},
        }
    )


def test_no_datasets_is_the_held_out_set_as_before() -> None:
    p = plan()
    [suite] = build_suites(p)
    assert suite.name == "held_out" and suite.samples == 3 and suite.scorer is None and suite.group_requests
    assert suite.sampling == {"temperature": 0.6, "max_new_tokens": 5}  # top_p/top_k: the generator's
    assert suite.prompts == build_task(p.rollout.task, p.run.seed).eval_prompts()


def test_named_datasets_inherit_unset_sampling_and_default_by_source(tmp_path) -> None:
    path = write_jsonl([{"prompt": f"q{i}", "answer": str(i)} for i in range(5)], tmp_path / "d.jsonl")
    p = plan(
        datasets={
            "aime": {
                "source": "aime_synthetic",
                "size": 4,
                "samples": 8,
                "temperature": 1.0,
                "max_new_tokens": 64,
            },
            "mine": {"source": "jsonl", "path": str(path), "size": 2, "prompt_template": "Q: {prompt}\nA:"},
            "digits3": {"source": "digits", "options": {"num_digits": 3}, "size": 4, "scorer": "exact_match"},
            "held": {"source": "held_out", "top_k": 5},
        }
    )
    aime, mine, digits3, held = build_suites(p)
    assert [s.name for s in (aime, mine, digits3, held)] == ["aime", "mine", "digits3", "held"]
    assert aime.samples == 8 and aime.scorer is scoring.boxed_math
    assert aime.sampling == {"temperature": 1.0, "top_p": 0.9, "top_k": -1, "max_new_tokens": 64}
    first = aime_synthetic_rows(4)[0]
    assert aime.prompts[0].text == BOXED_INSTRUCTION.replace("{prompt}", first["problem"])
    assert aime.prompts[0].answer == first["answer"] and aime.prompts[0].metadata["id"] == first["id"]
    assert [q.text for q in mine.prompts] == ["Q: q0\nA:", "Q: q1\nA:"] and mine.samples == 3
    assert mine.scorer is rewards.first_number  # the rollout reward
    assert mine.sampling == {"temperature": 0.6, "top_p": 0.9, "top_k": -1, "max_new_tokens": 5}
    assert len(digits3.prompts) == 4 and len(digits3.prompts[0].text.split()) == 5  # "last digit: a b c"
    assert digits3.scorer is rewards.exact_match
    assert held.sampling["top_k"] == 5 and len(held.prompts) == 6


def test_recipe_errors_name_the_key(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"eval\.datasets\.x\.source='nope'.*aime_synthetic"):
        build_suites(plan(datasets={"x": {"source": "nope"}}))
    with pytest.raises(ConfigError, match=r"eval\.datasets\.x\.scorer"):
        build_suites(plan(datasets={"x": {"source": "aime_synthetic", "scorer": "no_such"}}))
    with pytest.raises(ConfigError, match=r"eval\.datasets\.x\.path"):
        build_suites(plan(datasets={"x": {"source": "jsonl", "path": str(tmp_path / "none.jsonl")}}))
    with pytest.raises(ConfigError, match=r"eval\.datasets\.x\.options"):
        build_suites(plan(datasets={"x": {"source": "aime_synthetic", "options": {"seeds": 1}}}))
    for bad in (
        {"a/b": {}},
        {"snapshots": {}},  # RUN_DIR/eval/snapshots holds the eval snapshots
        {"x": {"source": "aime"}},
        {"x": {"samples": 0}},
        {"x": {"prompt_template": "no slot"}},
        {"x": {"temprature": 0.5}},
    ):
        with pytest.raises(ValidationError):
            plan(datasets=bad)


def test_real_aime_file_through_the_recipe(tmp_path) -> None:
    rows = [
        {"id": 60 + i, "problem": f"P{i}", "solution": "", "answer": a} for i, a in enumerate(["204", "025"])
    ]
    path = write_jsonl(rows, tmp_path / "aime_2024.jsonl")
    [suite] = build_suites(plan(datasets={"aime24": {"source": "aime", "path": str(path), "samples": 16}}))
    assert [q.metadata["id"] for q in suite.prompts] == [60, 61] and suite.samples == 16
    assert suite.prompts[1].text.startswith("P1\n\n") and "\\boxed{}" in suite.prompts[1].text
    assert suite.prompts[1].metadata["problem"] == "P1"
    assert json.loads(path.read_text().splitlines()[1])["answer"] == "025"
