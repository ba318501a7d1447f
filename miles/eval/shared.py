"""Evaluation on the shared rollout engines: pass@1 and pass@k over the task's held-out prompts.

For each held-out prompt, k = `eval.samples_per_prompt` samples are drawn at `eval.temperature`.
With c correct samples out of k:

    pass@1 = mean over prompts of c / k
    pass@k = mean over prompts of [c > 0]   (the unbiased estimator 1 - C(k-c, k)/C(k, k) for n = k)

A sample counts as correct when its reward is >= 1 (rewards of the built-in checkers are 0 or 1).
The weight versions of every evaluated token are reported, so a result can be checked to come from
one step's weights.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from miles.config.eval import EvalConfig
from miles.rollout.generate import Generator, sample_group
from miles.rollout.tasks import Prompt
from miles.sample import Status


async def evaluate(
    generator: Generator,
    prompts: list[Prompt],
    cfg: EvalConfig,
    max_new_tokens: int,
    group_requests: bool = False,
) -> dict[str, float]:
    """Score every held-out prompt k times; returns eval/* metrics. Raises if every request failed."""
    start = time.monotonic()
    sampling = dict(generator.sampling, temperature=cfg.temperature, max_new_tokens=max_new_tokens)
    k = cfg.samples_per_prompt
    ids = [generator.encoder.prompt_ids(p) for p in prompts]
    if group_requests:
        gen = dataclasses.replace(generator, sampling=sampling)
        groups = await asyncio.gather(
            *(sample_group(gen, p, -1 - i, k, ids[i]) for i, p in enumerate(prompts))
        )
        samples = [s for g in groups for s in g]
    else:
        jobs = [
            generator.sample(p, -1 - i, j, sampling, ids[i]) for i, p in enumerate(prompts) for j in range(k)
        ]
        samples = list(await asyncio.gather(*jobs))
    ok = [s for s in samples if s.status in (Status.COMPLETED, Status.TRUNCATED)]
    if not ok:
        raise RuntimeError(
            f"evaluation: all {len(samples)} requests failed ({samples[0].metadata.get('error')})"
        )
    correct = [[s.reward >= 1.0 for s in samples[i * k : (i + 1) * k]] for i in range(len(prompts))]
    versions = [v for s in ok for v in s.weight_versions]
    return {
        "eval/pass@1": sum(sum(c) / k for c in correct) / len(prompts),
        "eval/pass@k": sum(any(c) for c in correct) / len(prompts),
        "eval/k": float(k),
        "eval/reward_mean": sum(s.reward for s in ok) / len(ok),
        "eval/response_len_mean": sum(s.response_length for s in ok) / len(ok),
        "eval/failed_requests": float(len(samples) - len(ok)),
        "eval/weight_version_min": float(min(versions, default=0)),
        "eval/weight_version_max": float(max(versions, default=0)),
        "time/eval_s": time.monotonic() - start,
    }
