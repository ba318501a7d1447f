"""Evaluation on a given set of engines: every configured dataset, each with its own sampling.

The entry point for every evaluation mode (shared engines, a dedicated eval engine group, ...):

    suites = build_suites(plan, task)                       # miles.eval.datasets, once per run
    metrics = await evaluate_suites(generator, suites, step, RUN_DIR / "eval")

`evaluate_suites(generator, suites, step, out_dir=None) -> dict[str, float]` samples every prompt
of every suite `suite.samples` times on `generator`'s engines (the suite's sampling over the
generator's, the suite's scorer instead of the generator's reward), all suites concurrently, and
returns the metrics of miles.eval.metrics: `eval/<name>/<metric>` per dataset and `eval/<metric>`
over the datasets (`eval/pass@1`, `eval/weight_version_min`, ...), plus `time/eval_s`. With
`out_dir`, every sample is also written to `out_dir/<name>/step_<step>.jsonl` (atomically: a
temporary file renamed into place), one object a line:

    {"dataset", "step", "prompt_index", "id", "sample", "prompt", "output", "answer", "score",
     "correct", "prompt_tokens", "response_tokens", "finish_reason" (stop|length|abort|failed),
     "weight_versions" (distinct versions of its tokens, ascending), "error" (failed ones only)}

A dataset whose requests all fail is reported as `eval/<name>/failed = 1` and the others still
count; when every dataset fails, RuntimeError is raised (the caller counts a skipped evaluation).
A scorer that raises scores that sample 0 and is counted in `eval/<name>/scorer_errors`.

`evaluate(generator, prompts, cfg, max_new_tokens, group_requests)` is the older single-dataset
call (the held-out prompts, no sample files), kept for callers not yet passing suites.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from miles.config.eval import EvalConfig
from miles.eval.datasets import DEFAULT_NAME, EvalSuite
from miles.eval.metrics import ANSWERED, dataset_metrics, is_correct, summary
from miles.eval.scoring import Scorer
from miles.rollout.client import EngineError
from miles.rollout.generate import Generator, sample_group
from miles.rollout.tasks import Prompt
from miles.sample import Sample, Status

log = logging.getLogger("miles.eval")

FINISH_REASONS = {
    Status.COMPLETED: "stop",
    Status.TRUNCATED: "length",
    Status.ABORTED: "abort",
    Status.FAILED: "failed",
}


def _safe(scorer: Scorer) -> Scorer:
    """The scorer, with an exception scoring 0 and noted in the sample's metadata (counted, not raised)."""

    def score(sample: Sample) -> float:
        try:
            return float(scorer(sample))
        except Exception as e:
            sample.metadata["scorer_error"] = f"{type(e).__name__}: {e}"
            return 0.0

    return score


def _view(generator: Generator, suite: EvalSuite) -> Generator:
    """The generator with the suite's sampling and scorer. A shallow copy, not a new Generator: it
    shares the `ready` gate and clients (constructing one would re-open the gate)."""
    view = copy.copy(generator)
    view.sampling = {**generator.sampling, **suite.sampling}
    view.reward_fn = _safe(suite.scorer or generator.reward_fn)
    return view


def _failed(prompt: Prompt, group_id: int, index: int, ids: list[int] | None, error: Exception) -> Sample:
    s = Sample(
        group_id, index, list(ids or []), prompt=prompt.text, answer=prompt.answer, status=Status.FAILED
    )
    s.metadata.update(prompt.metadata, error=f"{type(error).__name__}: {error}")
    return s


async def _prompt_samples(gen: Generator, suite: EvalSuite, i: int, prompt: Prompt) -> list[Sample]:
    """The suite's samples of one prompt; a request the engine refuses (4xx) becomes a failed sample."""
    # a generate plug-in (rollout.generate_fn / agent_fn) builds its own tokens from the prompt
    ids = (
        gen.encoder.prompt_ids(prompt)
        if suite.group_requests or getattr(gen, "plugin", None) is None
        else None
    )
    group_id = -1 - i
    if suite.group_requests:
        try:
            return await sample_group(gen, prompt, group_id, suite.samples, ids)
        except EngineError as e:
            return [_failed(prompt, group_id, j, ids, e) for j in range(suite.samples)]

    async def one(j: int) -> Sample:
        try:
            return await gen.sample(prompt, group_id, j, gen.sampling, ids)
        except EngineError as e:
            return _failed(prompt, group_id, j, ids, e)

    return list(await asyncio.gather(*(one(j) for j in range(suite.samples))))


async def run_suite(generator: Generator, suite: EvalSuite) -> list[list[Sample]]:
    """Every sample of one suite, grouped by prompt (in prompt order)."""
    gen = _view(generator, suite)
    return list(
        await asyncio.gather(*(_prompt_samples(gen, suite, i, p) for i, p in enumerate(suite.prompts)))
    )


def sample_record(name: str, step: int | None, prompt: Prompt, s: Sample) -> dict[str, Any]:
    """The per-sample line of the eval JSONL."""
    record = {
        "dataset": name,
        "step": step,
        "prompt_index": prompt.index,
        "id": prompt.metadata.get("id", prompt.index),
        "sample": s.index,
        "prompt": s.prompt,
        "output": s.response,
        "answer": s.answer,
        "score": s.reward,
        "correct": s.status in ANSWERED and is_correct(s),
        "prompt_tokens": len(s.prompt_ids),
        "response_tokens": s.response_length,
        "finish_reason": FINISH_REASONS[s.status],
        "weight_versions": sorted(set(s.weight_versions)),
    }
    for key in ("error", "scorer_error"):
        if key in s.metadata:
            record[key] = s.metadata[key]
    return record


def write_samples(path: Path, records: list[dict[str, Any]]) -> Path:
    """Write records as JSONL at `path` atomically (temporary file, fsync, rename); returns the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write("".join(json.dumps(r, default=str) + "\n" for r in records))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def samples_path(out_dir: Path, name: str, step: int) -> Path:
    """Where the samples of dataset `name` evaluated at `step` are written."""
    return Path(out_dir) / name / f"step_{step}.jsonl"


def _suite_result(
    suite: EvalSuite, groups: list[list[Sample]], step: int | None, out_dir: Path | None
) -> tuple[dict[str, float], str | None]:
    """(metrics, why it failed or None) of one finished suite; writes its samples when asked."""
    if out_dir is not None and step is not None:
        records = [
            sample_record(suite.name, step, p, s)
            for p, g in zip(suite.prompts, groups, strict=True)
            for s in g
        ]
        write_samples(samples_path(out_dir, suite.name, step), records)
    if any(s.status in ANSWERED for g in groups for s in g):
        return dataset_metrics(groups, suite.samples), None
    error = next((s.metadata.get("error") for g in groups for s in g), None)
    return {}, f"all {sum(map(len, groups))} requests failed ({error})"


async def evaluate_suites(
    generator: Generator, suites: list[EvalSuite], step: int | None = None, out_dir: Path | None = None
) -> dict[str, float]:
    """Evaluate every suite on `generator`'s engines; see the module docstring for what it returns/writes."""
    if not suites:
        raise ValueError("evaluate_suites needs at least one suite (eval.datasets)")
    start = time.monotonic()
    results = await asyncio.gather(*(run_suite(generator, s) for s in suites), return_exceptions=True)
    per_dataset: dict[str, dict[str, float]] = {}
    failed: dict[str, str] = {}
    for suite, groups in zip(suites, results, strict=True):
        if isinstance(groups, BaseException) and not isinstance(groups, Exception):
            raise groups  # cancellation and interrupts are not evaluation failures
        if isinstance(groups, Exception):
            failed[suite.name] = f"{type(groups).__name__}: {groups}"
            continue
        metrics, why = _suite_result(suite, groups, step, out_dir)
        if why is None:
            per_dataset[suite.name] = metrics
        else:
            failed[suite.name] = why
    for name, why in failed.items():
        log.warning("evaluation of dataset %s failed: %s", name, why)
    if len(failed) == len(suites):
        raise RuntimeError(
            f"evaluation: every dataset failed ({'; '.join(f'{n}: {w}' for n, w in failed.items())})"
        )
    out = summary(per_dataset)
    out.update({f"eval/{name}/failed": 1.0 for name in failed})
    out["time/eval_s"] = time.monotonic() - start
    return out


async def evaluate(
    generator: Generator,
    prompts: list[Prompt],
    cfg: EvalConfig,
    max_new_tokens: int,
    group_requests: bool = False,
) -> dict[str, float]:
    """The held-out prompts, k = eval.samples_per_prompt samples each at eval.temperature, scored by the
    generator's reward; the metrics of `evaluate_suites` for one dataset named `held_out`."""
    sampling = {"temperature": cfg.temperature, "max_new_tokens": max_new_tokens}
    suite = EvalSuite(DEFAULT_NAME, prompts, cfg.samples_per_prompt, sampling, None, group_requests)
    return await evaluate_suites(generator, [suite])
