"""Evaluation: when, on which prompts, with which sampling, on which engines."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from miles.config.base import Section

_DATASET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class EvalDatasetConfig(Section):
    """One named evaluation dataset and how it is sampled and scored (miles/eval/datasets.py).

    Unset sampling keys inherit: `samples` from eval.samples_per_prompt, `temperature` from
    eval.temperature, `top_p`/`top_k`/`max_new_tokens` from rollout."""

    source: str = "held_out"
    """`held_out` (the rollout task's held-out prompts), `jsonl`/`parquet` (the file at `path`), `aime`
    (an AIME 2024/2025 file at `path`, columns found by name), `aime_synthetic` (procedural AIME-format
    problems, generated deterministically), or a rollout task name (`digits`, ...: its held-out prompts)."""
    path: str | None = None
    """Dataset file (JSONL or Parquet) for the `jsonl`, `parquet` and `aime` sources."""
    prompt_key: str | None = None
    """Column holding the prompt (default: `prompt`; for `aime`: problem/Problem/question)."""
    answer_key: str | None = None
    """Column holding the reference answer (default: `answer`; for `aime`: answer/Answer)."""
    id_key: str | None = None
    """Column holding a problem id, copied to the per-sample records (default: id/ID when present)."""
    options: dict[str, str | int | float | bool] = Field(default_factory=dict)
    """Source-specific options (a rollout task's options; `aime_synthetic`: seed)."""
    size: int | None = None
    """Evaluate the first N prompts only (generated sources: how many to generate); None: all."""
    samples: int | None = None
    """Samples per prompt (n of pass@k and mean@n); None: eval.samples_per_prompt."""
    temperature: float | None = None
    """Sampling temperature; None: eval.temperature."""
    top_p: float | None = None
    """Nucleus sampling threshold; None: rollout.top_p."""
    top_k: int | None = None
    """Top-k sampling (-1: off); None: rollout.top_k."""
    max_new_tokens: int | None = None
    """Cap on response length in tokens; None: rollout.max_new_tokens."""
    scorer: str | None = None
    """Scorer as `module:function` or a built-in name (miles/eval/scoring.py); None: `boxed_math` for
    the aime sources, rollout.reward otherwise. A sample is correct when it scores >= 1."""
    prompt_template: str | None = None
    """Text around each prompt, `{prompt}` marking where it goes; None: the aime sources ask for a
    boxed answer, the others send the prompt as it is."""

    @field_validator("samples", "size", "max_new_tokens")
    @classmethod
    def _positive(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"must be >= 1 (got {v})")
        return v

    @field_validator("top_p")
    @classmethod
    def _nucleus(cls, v: float | None) -> float | None:
        if v is not None and not 0.0 < v <= 1.0:
            raise ValueError(f"must be in (0, 1] (got {v})")
        return v

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float | None) -> float | None:
        if v is not None and v < 0.0:
            raise ValueError(f"must be >= 0 (0: greedy; got {v})")
        return v

    @field_validator("prompt_template")
    @classmethod
    def _has_slot(cls, v: str | None) -> str | None:
        if v is not None and "{prompt}" not in v:
            raise ValueError("must contain `{prompt}`, where the prompt text goes")
        return v

    @model_validator(mode="after")
    def _path_given(self) -> EvalDatasetConfig:
        if self.source in ("jsonl", "parquet", "aime") and not self.path:
            raise ValueError(f"source {self.source!r} needs `path` (a JSONL or Parquet file)")
        return self


class EvalConfig(Section):
    """Evaluation on held-out prompts: when, on which engines (`mode`), and how much may queue up."""

    every_steps: int = 5
    """Evaluate every N training steps (and before the first); 0 turns evaluation off."""
    samples_per_prompt: int = 4
    """k of pass@k; pass@1 is the mean over these samples."""
    temperature: float = 0.0
    """Sampling temperature for evaluation (0: greedy, then pass@k = pass@1)."""
    datasets: dict[str, EvalDatasetConfig] = Field(default_factory=dict)
    """Named evaluation datasets, each with its own sampling (metrics `eval/<name>/...`); empty: one
    dataset, `held_out`, the rollout task's held-out prompts with the settings above."""
    mode: Literal["shared", "dedicated", "external"] = "shared"
    """Where evaluation runs (miles/eval/modes.py): `shared` on the rollout engines between steps (the
    fully async producer pauses for it); `dedicated` on eval engines of their own, from a snapshot of
    the step's weights, while training goes on; `external` a function (`external_fn`) given the
    snapshot directory, in a process of its own, while training goes on."""
    external_fn: str | None = None
    """`module:function` (or `module.function`) called as fn(snapshot_dir) -> {metric: value} in
    `external` mode; the directory holds a Hugging Face model (config, safetensors, tokenizer)."""
    num_engines: int = 1
    """`dedicated` mode: eval engines (started beside the trainer by `miles train`; under Slurm the
    eval group's engines)."""
    max_in_flight: int = 1
    """Evaluations exported but not yet finished, at most (`dedicated`/`external` modes)."""
    overflow: Literal["wait", "skip"] = "wait"
    """When `max_in_flight` evaluations are pending at an eval step: `wait` holds training until one
    finishes, `skip` skips this step's evaluation (counted as eval/skipped_overflow)."""
    keep_snapshots: int = 2
    """Evaluated snapshots (RUN_DIR/eval/snapshots/step_N) kept on disk, newest first; 0 deletes each
    once evaluated. Snapshots still queued or being evaluated are always kept."""
    timeout_s: float = 1800.0
    """An evaluation running longer is stopped and skipped (eval/skipped_timeout)."""
    cpus: list[int] = []
    """Local runs, `dedicated` mode: host cores (as `taskset -c` numbers them) kept for the eval
    engines, which are pinned to them; the rollout engines and trainer ranks run on the others, so
    evaluation takes no core time from training. Empty: every process shares the host's cores."""

    @field_validator("datasets")
    @classmethod
    def _names(cls, v: dict[str, EvalDatasetConfig]) -> dict[str, EvalDatasetConfig]:
        bad = [n for n in v if not _DATASET_NAME.match(n)]
        if bad:
            raise ValueError(
                f"dataset names {bad} must be letters, digits, `_`, `.` or `-` (they name metric keys and files)"
            )
        taken = [n for n in v if n == "snapshots" or re.fullmatch(r"step_\d+", n)]
        if taken:
            raise ValueError(
                f"dataset names {taken} are taken by RUN_DIR/eval/snapshots and eval/step_N; rename them"
            )
        return v

    @model_validator(mode="after")
    def _mode_settings(self) -> EvalConfig:
        if self.mode == "external" and not self.external_fn:
            raise ValueError("eval.mode=external needs eval.external_fn (`module:function`)")
        for key in ("num_engines", "max_in_flight"):
            if getattr(self, key) < 1:
                raise ValueError(f"eval.{key} must be >= 1 (got {getattr(self, key)})")
        if len(set(self.cpus)) != len(self.cpus) or any(c < 0 for c in self.cpus):
            raise ValueError(f"eval.cpus must list distinct core ids >= 0 (got {self.cpus})")
        if self.keep_snapshots < 0 or self.timeout_s <= 0:
            raise ValueError("eval.keep_snapshots must be >= 0 and eval.timeout_s > 0")
        return self
