"""Evaluation datasets: the named prompt sets of `eval.datasets`, each with its own sampling and scorer.

`build_suites(plan)` turns the recipe into a list of EvalSuite, one per dataset; with no
`eval.datasets` it returns the one suite evaluation always had, `held_out` (the rollout task's
held-out prompts, `eval.samples_per_prompt` samples at `eval.temperature`, scored by the rollout
reward). Sources (the SOURCES dict):

- `held_out`: the rollout task's held-out prompts.
- `jsonl` / `parquet`: every row of the file at `path` (`prompt_key`, `answer_key`; default
  `prompt`, `answer`), in file order.
- `aime`: an AIME 2024/2025 file as the common Hugging Face copies lay it out: HuggingFaceH4/aime_2024
  and math-ai/aime25 (`id`, `problem`, `answer`), Maxwell-Jia/AIME_2024 (`ID`, `Problem`, `Answer`),
  MathArena/aime_* (`problem_idx`, `problem`, `answer`), opencompass/AIME2025 (`question`, `answer`).
  The columns are found by these names unless the keys are given.
- `aime_synthetic`: procedural problems in the AIME layout (`id`, `problem`, `answer` as a string;
  integer answers 0-999, some written with leading zeros as AIME answer keys do), generated
  deterministically from `options.seed` at load time: a real-format dataset for tests and smoke
  runs with no download. `write_jsonl(aime_synthetic_rows(n), path)` writes it as a file.
- any rollout task name (`digits`, `reasoning_gym`, ...): that task's held-out prompts, built with
  `options` and `size` as its eval_size.

The aime sources default to the scorer `boxed_math` and to a prompt asking for a boxed answer; the
others to the rollout reward and the bare prompt. `size` keeps the first N prompts.
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles.config import ConfigError, Plan
from miles.config.eval import EvalDatasetConfig
from miles.config.rollout import TaskConfig
from miles.eval.scoring import Scorer, load_scorer
from miles.rollout.tasks import TASKS, AdapterTasks, Prompt, Task, build_task, plan_task, read_rows

BOXED_INSTRUCTION = "{prompt}\n\nPlease reason step by step, and put your final answer within \\boxed{}."
"""The prompt template of the aime sources (the usual one for reasoning models)."""

AIME_PROMPT_KEYS = ("problem", "Problem", "question")
AIME_ANSWER_KEYS = ("answer", "Answer")
AIME_ID_KEYS = ("id", "ID", "problem_idx")


@dataclass(frozen=True)
class EvalSuite:
    """One evaluation dataset, ready to run: prompts, samples per prompt, sampling and scorer."""

    name: str
    prompts: list[Prompt]
    samples: int
    """Samples per prompt (n of pass@k)."""
    sampling: dict[str, Any] = field(default_factory=dict)
    """Overrides of the generator's sampling params (temperature, top_p, top_k, max_new_tokens)."""
    scorer: Scorer | None = None
    """Scores each sample (>= 1: correct); None: the generator's reward function."""
    group_requests: bool = False
    """Send a prompt's samples as one batched /generate request."""


def _pick(columns: list[str], given: str | None, candidates: tuple[str, ...], key: str, path: str) -> str:
    if given is not None:
        if given not in columns:
            raise ConfigError(
                f"{path}: rows have no column {given!r} (columns: {', '.join(columns)}); set {key}"
            )
        return given
    for name in candidates:
        if name in columns:
            return name
    raise ConfigError(
        f"{path}: none of the columns {', '.join(candidates)} is present (columns: {', '.join(columns)}); "
        f"set {key}"
    )


def rows_to_prompts(
    rows: list[dict[str, Any]], prompt_key: str, answer_key: str, id_key: str | None
) -> list[Prompt]:
    """Rows -> prompts in row order; the id (or the row number) travels in metadata['id']."""
    return [
        Prompt(i, str(row[prompt_key]), row[answer_key], {"id": row[id_key] if id_key else i})
        for i, row in enumerate(rows)
    ]


def load_rows(path: str, cfg_key: str) -> list[dict[str, Any]]:
    """The rows of a JSONL or Parquet file; an empty or missing file names `cfg_key`."""
    if not Path(path).is_file():
        raise ConfigError(f"{cfg_key}={path!r} does not exist; give a JSONL or Parquet file")
    rows = read_rows(path)
    if not rows:
        raise ConfigError(f"{cfg_key}={path!r} holds no rows")
    return rows


def load_aime(
    path: str,
    prompt_key: str | None = None,
    answer_key: str | None = None,
    id_key: str | None = None,
    cfg_key: str = "eval.datasets.<name>",
) -> list[Prompt]:
    """An AIME JSONL/Parquet file in any of the common layouts (module docstring) -> prompts."""
    rows = load_rows(path, f"{cfg_key}.path")
    columns = list(rows[0])
    p = _pick(columns, prompt_key, AIME_PROMPT_KEYS, f"{cfg_key}.prompt_key", path)
    a = _pick(columns, answer_key, AIME_ANSWER_KEYS, f"{cfg_key}.answer_key", path)
    return rows_to_prompts(rows, p, a, _id_column(columns, id_key, f"{cfg_key}.id_key", path))


def _id_column(columns: list[str], given: str | None, key: str, path: str) -> str | None:
    """The id column: the given one (which must exist), else the first of AIME_ID_KEYS present, else None."""
    if given is not None:
        return _pick(columns, given, (), key, path)
    return next((k for k in AIME_ID_KEYS if k in columns), None)


def _remainder_of_power(rng: random.Random) -> tuple[str, int]:
    a, b, m = rng.randint(2, 99), rng.randint(10, 2024), rng.choice([1000, 997, 125, 999, 512])
    return f"Find the remainder when ${a}^{{{b}}}$ is divided by ${m}$.", pow(a, b, m)


def _divisor_count(rng: random.Random) -> tuple[str, int]:
    n = rng.randint(2, 60) * rng.randint(2, 60) * rng.choice([1, 6, 10, 12, 30])
    count = sum(2 - (d * d == n) for d in range(1, math.isqrt(n) + 1) if n % d == 0)
    return f"How many positive integers divide ${n}$?", count


def _sum_of_squares(rng: random.Random) -> tuple[str, int]:
    x, y = rng.randint(1, 20), rng.randint(1, 20)
    text = (
        f"Real numbers $x$ and $y$ satisfy $x + y = {x + y}$ and $xy = {x * y}$. Find the value of "
        "$x^2 + y^2$."
    )
    return text, x * x + y * y


def _binomial_mod(rng: random.Random) -> tuple[str, int]:
    n, k = rng.randint(10, 60), rng.randint(2, 8)
    return f"Find the remainder when $\\binom{{{n}}}{{{k}}}$ is divided by $1000$.", math.comb(n, k) % 1000


def _coprime_count(rng: random.Random) -> tuple[str, int]:
    n = rng.randint(20, 999)
    count = sum(math.gcd(a, n) == 1 for a in range(1, n))
    return (
        f"Find the number of ordered pairs of positive integers $(a, b)$ with $a + b = {n}$ and "
        f"$\\gcd(a, b) = 1$.",
        count,
    )


_AIME_TEMPLATES: tuple[Callable[[random.Random], tuple[str, int]], ...] = (
    _remainder_of_power,
    _divisor_count,
    _sum_of_squares,
    _binomial_mod,
    _coprime_count,
)


def aime_synthetic_rows(n: int = 30, seed: int = 0) -> list[dict[str, Any]]:
    """n procedural problems in the AIME layout: {"id", "problem", "answer"}, answers "000"-"999"
    (a third written zero-padded to three digits, as AIME answer keys do). Deterministic in (n, seed)."""
    rows = []
    for i in range(n):
        rng = random.Random(f"aime_synthetic:{seed}:{i}")
        text, value = _AIME_TEMPLATES[i % len(_AIME_TEMPLATES)](rng)
        assert 0 <= value <= 999, (text, value)
        answer = f"{value:03d}" if i % 3 == 2 else str(value)
        rows.append({"id": f"synthetic-{seed}-{i + 1}", "problem": text, "answer": answer})
    return rows


def write_jsonl(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Rows as a JSONL file (one object a line), written beside it and renamed into place (a reader
    sees all rows or none); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)
    return path


def _source_prompts(name: str, cfg: EvalDatasetConfig, plan: Plan, task: Task | None) -> list[Prompt]:
    """The raw prompts of one dataset's source (before template and size)."""
    key = f"eval.datasets.{name}"
    if cfg.source == "held_out":
        return (task or plan_task(plan)).eval_prompts()
    if cfg.source in ("jsonl", "parquet"):
        rows = load_rows(str(cfg.path), f"{key}.path")
        columns = list(rows[0])
        p = _pick(columns, cfg.prompt_key, ("prompt",), f"{key}.prompt_key", str(cfg.path))
        a = _pick(columns, cfg.answer_key, ("answer",), f"{key}.answer_key", str(cfg.path))
        return rows_to_prompts(rows, p, a, _id_column(columns, cfg.id_key, f"{key}.id_key", str(cfg.path)))
    if cfg.source == "aime":
        return load_aime(str(cfg.path), cfg.prompt_key, cfg.answer_key, cfg.id_key, key)
    if cfg.source == "aime_synthetic":
        unknown = set(cfg.options) - {"seed"}
        if unknown:
            raise ConfigError(
                f"{key}.options: unknown {', '.join(sorted(unknown))}; aime_synthetic knows: seed"
            )
        rows = aime_synthetic_rows(cfg.size or 30, int(cfg.options.get("seed", 0)))
        return rows_to_prompts(rows, "problem", "answer", "id")
    if cfg.source in TASKS:
        size = cfg.size or plan.rollout.task.eval_size
        task_cfg = TaskConfig(name=cfg.source, path=cfg.path, options=cfg.options, eval_size=size)
        return build_task(task_cfg, plan.run.seed).eval_prompts()
    known = ["held_out", "jsonl", "parquet", "aime", "aime_synthetic", *(t for t in TASKS if t != "jsonl")]
    raise ConfigError(
        f"{key}.source={cfg.source!r} is unknown; known sources: {', '.join(dict.fromkeys(known))}"
    )


def apply_template(prompts: list[Prompt], template: str | None) -> list[Prompt]:
    """Each prompt's text put into `template` at `{prompt}` (prompts given as token ids stay as they are);
    the text before templating stays in metadata['problem']."""
    if template is None:
        return prompts
    return [
        p
        if "input_ids" in p.metadata
        else Prompt(
            p.index, template.replace("{prompt}", p.text), p.answer, {**p.metadata, "problem": p.text}
        )
        for p in prompts
    ]


def build_suite(name: str, cfg: EvalDatasetConfig, plan: Plan, task: Task | None = None) -> EvalSuite:
    """One dataset of the recipe as a runnable suite; unset sampling keys inherit (eval, then rollout)."""
    aime = cfg.source in ("aime", "aime_synthetic")
    prompts = _source_prompts(name, cfg, plan, task)
    if cfg.size is not None:
        prompts = prompts[: cfg.size]
    if not prompts:
        raise ConfigError(f"eval.datasets.{name}: no prompts (source {cfg.source!r}); check its file or size")
    prompts = apply_template(prompts, cfg.prompt_template or (BOXED_INSTRUCTION if aime else None))
    e, r = plan.eval, plan.rollout
    sampling = {
        "temperature": e.temperature if cfg.temperature is None else cfg.temperature,
        "top_p": r.top_p if cfg.top_p is None else cfg.top_p,
        "top_k": r.top_k if cfg.top_k is None else cfg.top_k,
        "max_new_tokens": cfg.max_new_tokens or r.max_new_tokens,
    }
    spec = cfg.scorer or ("boxed_math" if aime else r.reward)
    scorer = load_scorer(spec, f"eval.datasets.{name}.scorer" if cfg.scorer else "rollout.reward")
    samples = cfg.samples or e.samples_per_prompt
    return EvalSuite(name, prompts, samples, sampling, scorer, r.group_requests)


DEFAULT_NAME = "held_out"
"""The name of the one dataset evaluated when `eval.datasets` is empty."""


def build_suites(plan: Plan, task: Task | None = None) -> list[EvalSuite]:
    """Every dataset of `eval.datasets`, in recipe order; none configured: the rollout task's held-out
    prompts as `held_out`, sampled as evaluation always was (eval.temperature, rollout.max_new_tokens,
    the rollout top_p/top_k) and scored by the generator's reward function. `task`: the rollout task
    when the caller has it built already."""
    if not plan.eval.datasets:
        e, r = plan.eval, plan.rollout
        task = task or plan_task(plan)
        sampling = {"temperature": e.temperature, "max_new_tokens": r.max_new_tokens}
        if isinstance(task, AdapterTasks):  # several LoRA adapters: one held-out set each, named after it
            sets = [(name, task.eval_prompts_of(name)) for name, _ in task.parts]
        else:
            sets = [(DEFAULT_NAME, task.eval_prompts())]
        return [
            EvalSuite(name, prompts, e.samples_per_prompt, sampling, None, r.group_requests)
            for name, prompts in sets
        ]
    return [build_suite(name, cfg, plan, task) for name, cfg in plan.eval.datasets.items()]
