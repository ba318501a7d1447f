"""Weights & Biases as an optional second sink of the metrics logger (config `observe.wandb`).

`with_wandb(writer, run_dir, resume_step)` is called by MetricsLogger (miles/metrics.py) with its
TensorBoard writer (or None). When RUN_DIR/plan.yaml enables `observe.wandb`, it returns a writer of
the same shape (`add_scalar`, `flush`, `close`) that forwards to TensorBoard and to a W&B run; else it
returns the writer unchanged, and wandb is never imported.

- One W&B row per step: the scalars of a step are gathered by `add_scalar` and sent at `flush`
  (MetricsLogger flushes once per step) as `{"step": N, ...}`. Every metric is plotted against
  `step` (`define_metric("*", step_metric="step")`), so an evaluation amended steps later lands at the
  step whose weights it measured.
- The plan is the run's config, logged once, when the W&B run is created.
- Offline mode (`observe.wandb.mode: offline`) is passed to `wandb.init` (never an environment
  variable): the run is written under RUN_DIR/wandb/ and can be uploaded later with `wandb sync`.
- A resumed run continues the same W&B run: its id is kept in RUN_DIR/wandb/run_id. Steps after the
  checkpoint are trained again and logged again (W&B cannot drop logged rows offline; metrics.jsonl
  and TensorBoard are cut back to the checkpoint's step).
- Sweep points are grouped by `observe.wandb.group`, else by the sweep tag (launch.sweep_tag); the
  Slurm array task id, when there is one, is added to the config as `array_task_id`.
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Any

from miles.config import ConfigError

log = logging.getLogger(__name__)


class WandbWriter:
    """A TensorBoard-writer-shaped sink: scalars buffered per step, one W&B row per step at flush."""

    def __init__(self, run: Any, inner: Any | None) -> None:
        self.run = run
        self.inner = inner
        """The TensorBoard writer, when run.tensorboard is on (else None)."""
        self._pending: dict[int, dict[str, float]] = {}

    def add_scalar(self, key: str, value: float, step: int) -> None:
        self._pending.setdefault(int(step), {})[key] = float(value)
        if self.inner is not None:
            self.inner.add_scalar(key, value, step)

    def flush(self) -> None:
        for step in sorted(self._pending):
            self.run.log({"step": step, **self._pending[step]})
        self._pending.clear()
        if self.inner is not None:
            self.inner.flush()

    def close(self) -> None:
        import wandb

        self.flush()
        self.run.finish()
        wandb.teardown()  # stops wandb's service process, which writes out the run file only then
        if self.inner is not None:
            self.inner.close()


def with_wandb(writer: Any | None, run_dir: str | Path, resume_step: int | None = None) -> Any | None:
    """`writer` itself, or a WandbWriter around it when RUN_DIR/plan.yaml enables observe.wandb."""
    plan_file = Path(run_dir) / "plan.yaml"
    if not plan_file.is_file():
        return writer
    import yaml

    raw = yaml.safe_load(plan_file.read_text()) or {}
    if not ((raw.get("observe") or {}).get("wandb") or {}).get("enabled"):
        return writer  # the whole plan is validated only when W&B is asked for
    from miles.config.resolve import read_plan

    plan = read_plan(plan_file)
    return WandbWriter(start_run(plan, Path(run_dir), resumed=resume_step is not None), writer)


def start_run(plan: Any, run_dir: Path, resumed: bool) -> Any:
    """Create (or, on resume, continue) the W&B run of `plan`; its config is the plan."""
    cfg = plan.observe.wandb
    try:
        import wandb
    except ImportError as e:
        raise ConfigError(
            "observe.wandb.enabled is true but the `wandb` package is not installed: "
            "pip install 'miles[wandb]' (or set observe.wandb.enabled=false)"
        ) from e
    from miles.cluster.environment import JobEnvironment

    wandb_dir = run_dir / "wandb"
    wandb_dir.mkdir(parents=True, exist_ok=True)
    id_file = wandb_dir / "run_id"
    if resumed and id_file.is_file():
        run_id = id_file.read_text().strip()
    else:
        run_id = f"{plan.run.name}-{uuid.uuid4().hex[:8]}"
        id_file.write_text(run_id + "\n")
    config = plan.model_dump(mode="json")
    array_task = JobEnvironment.from_env().array_task_id
    if array_task is not None:
        config["array_task_id"] = array_task
    run = wandb.init(
        project=cfg.project,
        entity=cfg.entity,
        mode=cfg.mode,
        dir=str(run_dir),
        id=run_id,
        name=plan.run.name,
        group=cfg.group or plan.launch.sweep_tag,
        tags=list(cfg.tags),
        config=config,
        resume="allow",
        settings=wandb.Settings(console="off"),  # the run's own logs are under RUN_DIR/logs
    )
    run.define_metric("step")
    run.define_metric("*", step_metric="step")
    log.info("W&B run %s (%s, project %s) for %s", run_id, cfg.mode, cfg.project, run_dir)
    return run
