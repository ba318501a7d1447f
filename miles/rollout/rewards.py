"""Reward functions: one finished Sample in, one float out.

A reward is any function `fn(sample: Sample) -> float`, named in the recipe by dotted path
(`rollout.reward: package.module:function`). It sees the response text, the reference answer and the
task metadata. Built-ins:

- `exact_match`: 1 if the response (stripped, or the content of its last `\\boxed{}`) equals the answer.
- `first_number`: 1 if the first integer in the response equals the answer (lenient about what follows).
- `math_verify`: symbolic equality via the math-verify package, evaluated in a process pool with a
  timeout, because math-verify uses signal-based timeouts that misbehave in threads; a timeout or
  a crash of the checker scores 0 and never stops the run.
- `reasoning_gym`: the task's own `score_answer` for reasoning-gym datasets.
"""

from __future__ import annotations

import multiprocessing
import re
import threading
from collections.abc import Callable
from multiprocessing.pool import Pool
from typing import Any

from miles.config.plugins import load_function
from miles.sample import Sample

RewardFn = Callable[[Sample], float]

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_INT = re.compile(r"-?\d+")


def extract_answer(text: str) -> str:
    """The final answer of a response: the last `\\boxed{...}` if any, else the stripped text."""
    boxed = _BOXED.findall(text)
    return (boxed[-1] if boxed else text).strip()


def exact_match(sample: Sample) -> float:
    """1.0 when the extracted answer equals the reference answer as a string, else 0.0."""
    return float(extract_answer(sample.response) == str(sample.answer).strip())


def first_number(sample: Sample) -> float:
    """1.0 when the first integer in the response equals the reference answer, else 0.0."""
    match = _INT.search(sample.response)
    return float(match is not None and match.group(0) == str(sample.answer).strip())


def _warm() -> bool:
    import math_verify  # noqa: F401  (the import takes seconds; done once per worker, off the clock)

    return True


def _verify(gold: str, answer: str) -> bool:
    import math_verify

    return bool(math_verify.verify(math_verify.parse(gold), math_verify.parse(answer)))


class VerifyPool:
    """A small process pool for math-verify, rebuilt after a timeout (the stuck worker is terminated)."""

    def __init__(self, processes: int = 1, timeout_s: float = 5.0, startup_timeout_s: float = 120.0) -> None:
        self.processes, self.timeout_s, self.startup_timeout_s = processes, timeout_s, startup_timeout_s
        self._pool: Pool | None = None
        self._lock = threading.Lock()

    def verify(self, gold: str, answer: str) -> bool:
        with self._lock:
            if self._pool is None:
                self._pool = multiprocessing.get_context("spawn").Pool(self.processes)
                # start-up (spawn + import) is not part of the per-answer timeout
                self._pool.apply_async(_warm).get(self.startup_timeout_s)
            pool = self._pool
        try:
            return pool.apply_async(_verify, (gold, answer)).get(self.timeout_s)
        except multiprocessing.TimeoutError:
            with self._lock:
                if self._pool is pool:
                    pool.terminate()
                    self._pool = None
            return False
        except Exception:
            return False

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.terminate()
                self._pool.join()
                self._pool = None


MATH_POOL = VerifyPool()


def math_verify(sample: Sample) -> float:
    """1.0 when math-verify judges the response's final answer equal to the reference answer."""
    answer = extract_answer(sample.response)
    gold = str(sample.answer)
    gold = gold if "$" in gold or "\\" in gold else f"${gold}$"
    return float(MATH_POOL.verify(gold, f"${answer}$" if "$" not in answer else answer))


def reasoning_gym(sample: Sample) -> float:
    """The reasoning-gym dataset's own score of the response (entry carried in sample.metadata)."""
    import reasoning_gym as rg

    entry: dict[str, Any] | None = sample.metadata.get("entry")
    if entry is None:
        raise ValueError("reasoning_gym reward needs a reasoning_gym task (metadata['entry'] is missing)")
    score = rg.get_score_answer_fn(entry["metadata"]["source_dataset"])
    return float(score(extract_answer(sample.response), entry))


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "first_number": first_number,
    "math_verify": math_verify,
    "reasoning_gym": reasoning_gym,
}


def load_reward(spec: str) -> RewardFn:
    """`module:function` (or a built-in name) -> the function; errors name rollout.reward."""
    return load_function(spec, "rollout.reward", BUILTIN_REWARDS)
