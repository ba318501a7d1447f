"""Tasks: where prompts and reference answers come from, for training and for held-out evaluation.

A task is an indexable stream: `train_prompt(i)` is a pure function of (seed, i), so the loop only has
to checkpoint one integer (the next prompt index) to resume the data stream exactly. Evaluation
prompts are disjoint from training prompts: procedural tasks reserve an index range for them, and
dataset tasks hold out the first `eval_size` rows of a seeded permutation.

Built-ins (the TASKS dict below):
- `digits`: tiny procedural arithmetic over single-digit tokens ("last digit: 3 8 5" -> "5"); the
  default CPU task, learnable by RL from a random-initialised model in a few hundred steps.
- `jsonl`: rows of a JSONL or Parquet file with a prompt and an answer column.
- `env`: numbered episodes of the environment `rollout.env` (miles/agentic/tasks.py).
- `longtail`: synthetic prompts with Pareto-distributed response lengths (benchmarks of schedules).
- `random_tokens`: fixed-length random token prompts and responses (throughput benchmarks).
- `reasoning_gym`: any offline procedural dataset of the reasoning-gym package, scored by its own
  `score_answer` (see rewards.reasoning_gym).
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from miles.config import ConfigError
from miles.config.rollout import TaskConfig

EVAL_OFFSET = 1 << 40
"""Procedural tasks draw evaluation prompts from indices at and above this offset (never trained on)."""


@dataclass(frozen=True)
class Prompt:
    """One prompt of a task, before tokenisation."""

    index: int
    """Position in the task's stream (training) or in the held-out set (evaluation)."""
    text: str
    """The user message; the model's chat template wraps it."""
    answer: Any
    """Reference answer handed to the reward function."""
    metadata: dict[str, Any] = field(default_factory=dict)


class Task(Protocol):
    """A source of prompts. Implementations must be deterministic in (seed, index)."""

    name: str

    def train_prompt(self, index: int) -> Prompt:
        """The index-th training prompt (any index >= 0; datasets cycle with a fresh shuffle per epoch)."""
        ...

    def eval_prompts(self) -> list[Prompt]:
        """The held-out prompts, disjoint from every training prompt."""
        ...


_DIGIT_OPS: dict[str, tuple[str, Callable[[list[int]], int]]] = {
    "last": ("last digit:", lambda ds: ds[-1]),
    "first": ("first digit:", lambda ds: ds[0]),
    "max": ("max digit:", max),
    "sum": ("sum mod 10:", lambda ds: sum(ds) % 10),
}


class DigitsTask:
    """Procedural single-digit problems; the answer is one digit, which is one token."""

    name = "digits"

    def __init__(self, seed: int, eval_size: int, op: str = "last", num_digits: int = 3) -> None:
        if op not in _DIGIT_OPS:
            raise ConfigError(
                f"rollout.task.options.op={op!r} is not a digits operation; known: {', '.join(_DIGIT_OPS)}"
            )
        if not 1 <= num_digits <= 12:
            raise ConfigError(f"rollout.task.options.num_digits must be in 1..12 (got {num_digits})")
        if eval_size > 10**num_digits // 2:
            raise ConfigError(
                f"rollout.task.eval_size={eval_size} is too large for {num_digits} digits "
                f"({10**num_digits} distinct prompts); lower it or raise options.num_digits"
            )
        self.seed, self.eval_size, self.op, self.num_digits = seed, eval_size, op, num_digits
        self._eval: list[Prompt] = []
        seen: set[str] = set()
        for i in itertools.count():
            if len(self._eval) == eval_size:
                break
            p = self._make(EVAL_OFFSET + i, len(self._eval))
            if p.text not in seen:
                seen.add(p.text)
                self._eval.append(p)
        self._held_out = frozenset(seen)

    def _make(self, key: int, index: int, attempt: int = 0) -> Prompt:
        rng = random.Random(f"{self.seed}:{key}:{attempt}")
        digits = [rng.randint(0, 9) for _ in range(self.num_digits)]
        question, fn = _DIGIT_OPS[self.op]
        text = f"{question} {' '.join(map(str, digits))}"
        return Prompt(index, text, str(fn(digits)), {"digits": digits})

    def train_prompt(self, index: int) -> Prompt:
        """Draw again (deterministically) while the draw is one of the held-out prompts."""
        for attempt in itertools.count():
            p = self._make(index, index, attempt)
            if p.text not in self._held_out:
                return p
        raise AssertionError("unreachable")

    def eval_prompts(self) -> list[Prompt]:
        return list(self._eval)


def read_rows(path: str) -> list[dict[str, Any]]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"rollout.task.path={path!r} does not exist; give a JSONL or Parquet file")
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(p).to_pylist()
    rows = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{n} is not valid JSON ({e}); fix the dataset file") from None
    return rows


class LongTailTask:
    """Synthetic prompts whose response lengths follow a Pareto tail (for schedule benchmarks).

    Prompt i asks for L_i tokens, L_i = min(max_tokens, floor(min_tokens * U^(-1/alpha))) with U
    uniform in (0, 1]; the length travels as a per-prompt sampling override (max_new_tokens with
    ignore_eos), so the distribution holds whatever the model samples.
    """

    name = "longtail"

    def __init__(self, seed: int, eval_size: int, min_tokens: int, max_tokens: int, alpha: float) -> None:
        if not 1 <= min_tokens <= max_tokens or alpha <= 0:
            raise ConfigError(
                "rollout.task.options for longtail need 1 <= min_tokens <= max_tokens and alpha > 0 "
                f"(got {min_tokens}, {max_tokens}, {alpha})"
            )
        self.seed, self.eval_size = seed, eval_size
        self.min_tokens, self.max_tokens, self.alpha = min_tokens, max_tokens, alpha

    def train_prompt(self, index: int) -> Prompt:
        rng = random.Random(f"{self.seed}:{index}")
        u = 1.0 - rng.random()
        length = min(self.max_tokens, int(self.min_tokens * u ** (-1.0 / self.alpha)))
        sampling = {"max_new_tokens": length, "ignore_eos": True}
        return Prompt(index, f"count to {length}", str(length), {"sampling": sampling})

    def eval_prompts(self) -> list[Prompt]:
        return [self.train_prompt(EVAL_OFFSET + i) for i in range(self.eval_size)]


class RandomTokensTask:
    """Prompts of exactly `prompt_tokens` random token ids, answered with exactly `response_tokens`
    tokens (ignore_eos): fixed-shape work for throughput benchmarks. Token ids are drawn uniformly
    from [low, high), seeded by (seed, index); the ids travel in `metadata["input_ids"]` (no template)."""

    name = "random_tokens"

    def __init__(
        self, seed: int, eval_size: int, prompt_tokens: int, response_tokens: int, low: int, high: int
    ):
        if prompt_tokens < 1 or response_tokens < 1 or not 0 <= low < high:
            raise ConfigError(
                "rollout.task.options for random_tokens need prompt_tokens >= 1, response_tokens >= 1 and "
                f"0 <= low < high (got {prompt_tokens}, {response_tokens}, {low}, {high})"
            )
        self.seed, self.eval_size = seed, eval_size
        self.prompt_tokens, self.response_tokens, self.low, self.high = (
            prompt_tokens,
            response_tokens,
            low,
            high,
        )

    def train_prompt(self, index: int) -> Prompt:
        rng = random.Random(f"{self.seed}:{index}")
        ids = [rng.randrange(self.low, self.high) for _ in range(self.prompt_tokens)]
        sampling = {"max_new_tokens": self.response_tokens, "ignore_eos": True, "stop_token_ids": []}
        text = f"<{self.prompt_tokens} random tokens #{index}>"
        return Prompt(index, text, None, {"input_ids": ids, "sampling": sampling})

    def eval_prompts(self) -> list[Prompt]:
        return [self.train_prompt(EVAL_OFFSET + i) for i in range(self.eval_size)]


class DatasetTask:
    """Rows of a JSONL/Parquet file; the first `eval_size` rows of a seeded permutation are held out."""

    name = "jsonl"

    def __init__(self, seed: int, eval_size: int, path: str | None, prompt_key: str, answer_key: str) -> None:
        if not path:
            raise ConfigError("rollout.task.name=jsonl needs rollout.task.path (a JSONL or Parquet file)")
        rows = read_rows(path)
        for key in (prompt_key, answer_key):
            if rows and key not in rows[0]:
                raise ConfigError(
                    f"{path}: rows have no column {key!r} (columns: {', '.join(rows[0])}); "
                    "set rollout.task.prompt_key / rollout.task.answer_key"
                )
        order = list(range(len(rows)))
        random.Random(seed).shuffle(order)
        if len(rows) <= eval_size:
            raise ConfigError(
                f"{path} has {len(rows)} rows, not more than rollout.task.eval_size={eval_size}; "
                "lower eval_size or use a larger dataset"
            )
        self.seed = seed
        self._prompts = [
            Prompt(i, str(rows[r][prompt_key]), rows[r][answer_key], {"row": r}) for i, r in enumerate(order)
        ]
        self._eval = self._prompts[:eval_size]
        self._train = self._prompts[eval_size:]

    def train_prompt(self, index: int) -> Prompt:
        epoch, pos = divmod(index, len(self._train))
        order = list(range(len(self._train)))
        if epoch:
            random.Random(f"{self.seed}:epoch{epoch}").shuffle(order)
        p = self._train[order[pos]]
        return Prompt(index, p.text, p.answer, p.metadata)

    def eval_prompts(self) -> list[Prompt]:
        return list(self._eval)


class ReasoningGymTask:
    """An offline procedural reasoning-gym dataset; the entry travels in metadata for its scorer."""

    name = "reasoning_gym"

    def __init__(self, seed: int, eval_size: int, dataset: str = "basic_arithmetic", size: int = 10000):
        try:
            import reasoning_gym
        except ImportError as e:
            raise ConfigError("rollout.task.name=reasoning_gym needs the reasoning-gym package") from e
        try:
            self._train = reasoning_gym.create_dataset(dataset, seed=seed, size=size)
            self._eval = reasoning_gym.create_dataset(dataset, seed=seed + 7919, size=eval_size)
        except (KeyError, ValueError) as e:
            raise ConfigError(
                f"rollout.task.options.dataset={dataset!r}: reasoning-gym refused it ({e}); "
                "see reasoning_gym.factory for dataset names"
            ) from None
        self.dataset = dataset

    def _prompt(self, data: Any, index: int, ds_index: int) -> Prompt:
        entry = data[ds_index]
        return Prompt(index, entry["question"], entry["answer"], {"dataset": self.dataset, "entry": entry})

    def train_prompt(self, index: int) -> Prompt:
        return self._prompt(self._train, index, index % len(self._train))

    def eval_prompts(self) -> list[Prompt]:
        return [self._prompt(self._eval, i, i) for i in range(len(self._eval))]


def _options(cfg: TaskConfig, known: dict[str, object]) -> dict[str, object]:
    unknown = set(cfg.options) - set(known)
    if unknown:
        raise ConfigError(
            f"rollout.task.options: unknown option(s) {', '.join(sorted(unknown))} for task {cfg.name!r}; "
            f"known: {', '.join(known)}"
        )
    return {**known, **cfg.options}


def _digits(cfg: TaskConfig, seed: int) -> Task:
    opts = _options(cfg, {"op": "last", "num_digits": 3})
    return DigitsTask(seed, cfg.eval_size, str(opts["op"]), int(opts["num_digits"]))


def _dataset(cfg: TaskConfig, seed: int) -> Task:
    return DatasetTask(seed, cfg.eval_size, cfg.path, cfg.prompt_key, cfg.answer_key)


def _reasoning_gym(cfg: TaskConfig, seed: int) -> Task:
    opts = _options(cfg, {"dataset": "basic_arithmetic", "size": 10000})
    return ReasoningGymTask(seed, cfg.eval_size, str(opts["dataset"]), int(opts["size"]))


def _longtail(cfg: TaskConfig, seed: int) -> Task:
    opts = _options(cfg, {"min_tokens": 4, "max_tokens": 256, "alpha": 1.0})
    return LongTailTask(
        seed, cfg.eval_size, int(opts["min_tokens"]), int(opts["max_tokens"]), float(opts["alpha"])
    )


def _random_tokens(cfg: TaskConfig, seed: int) -> Task:
    opts = _options(cfg, {"prompt_tokens": 128, "response_tokens": 512, "low": 0, "high": 1000})
    keys = ("prompt_tokens", "response_tokens", "low", "high")
    return RandomTokensTask(seed, cfg.eval_size, *(int(opts[k]) for k in keys))


class EpisodeTask:
    """`rollout.task.name: env`: numbered episodes of the environment `rollout.env`. Training prompt i
    stands for the environment's task `make_task(seed, i)`, held-out prompt j for
    `make_task(seed, EVAL_OFFSET + j)`; the agentic generate function (miles/agentic/rollout.py) builds
    the environment and asks it for the task, so the stream knows no environment and checkpoints one
    integer like every task."""

    name = "env"

    def __init__(self, seed: int, eval_size: int) -> None:
        if eval_size < 1:
            raise ConfigError(f"rollout.task.eval_size must be >= 1 for environment tasks (got {eval_size})")
        self.seed, self.eval_size = seed, eval_size

    def _prompt(self, index: int, episode: int) -> Prompt:
        return Prompt(index, f"episode {episode}", None, {"episode": {"seed": self.seed, "index": episode}})

    def train_prompt(self, index: int) -> Prompt:
        return self._prompt(index, index)

    def eval_prompts(self) -> list[Prompt]:
        return [self._prompt(j, EVAL_OFFSET + j) for j in range(self.eval_size)]


def _episodes(cfg: TaskConfig, seed: int) -> Task:
    if cfg.options:
        raise ConfigError(
            f"rollout.task.options {sorted(cfg.options)}: the `env` task takes none; environment options "
            "go to rollout.env.options"
        )
    return EpisodeTask(seed, cfg.eval_size)


TASKS: dict[str, Callable[[TaskConfig, int], Task]] = {
    "env": _episodes,
    "digits": _digits,
    "longtail": _longtail,
    "random_tokens": _random_tokens,
    "jsonl": _dataset,
    "parquet": _dataset,
    "reasoning_gym": _reasoning_gym,
}


class AdapterTasks:
    """The prompt stream of a several-adapter LoRA run (train.lora.adapters): prompt i is prompt i // N
    of adapter i % N's task, so every adapter gets every N-th prompt and checkpoints still hold one
    integer. Each prompt carries its adapter's name as `metadata["lora_path"]`, which the generator
    sends with its requests and the trainer sorts samples by."""

    name = "adapters"

    def __init__(self, parts: list[tuple[str, Task]]) -> None:
        self.parts = parts

    @staticmethod
    def _tag(prompt: Prompt, name: str, index: int) -> Prompt:
        return Prompt(index, prompt.text, prompt.answer, {**prompt.metadata, "lora_path": name})

    def train_prompt(self, index: int) -> Prompt:
        name, task = self.parts[index % len(self.parts)]
        return self._tag(task.train_prompt(index // len(self.parts)), name, index)

    def eval_prompts_of(self, name: str) -> list[Prompt]:
        """The held-out prompts of adapter `name`'s task, tagged with it."""
        task = dict(self.parts)[name]
        return [self._tag(p, name, p.index) for p in task.eval_prompts()]

    def eval_prompts(self) -> list[Prompt]:
        return [p for name, _ in self.parts for p in self.eval_prompts_of(name)]


def plan_task(plan: Any) -> Task:
    """The run's prompt stream: rollout.task, or one task per adapter of train.lora.adapters."""
    lora = plan.train.lora
    if lora is not None and lora.adapters:
        return AdapterTasks([(a.name, build_task(a.task, plan.run.seed)) for a in lora.adapters])
    return build_task(plan.rollout.task, plan.run.seed)


def build_task(cfg: TaskConfig, seed: int) -> Task:
    """The task named by `rollout.task.name`; an unknown name lists the known ones."""
    if cfg.name not in TASKS:
        raise ConfigError(f"rollout.task.name={cfg.name!r} is unknown; known tasks: {', '.join(TASKS)}")
    return TASKS[cfg.name](cfg, seed)
