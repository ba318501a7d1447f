"""Run observability: RUN_DIR/metrics.jsonl (always), TensorBoard (optional), progress, PNG plots.

metrics.jsonl holds one JSON object per step, `{"step": N, "time": unix_s, "<group>/<name>": value}`,
appended, flushed and fsynced as each step ends, so a crash loses at most the step in progress.
Step 0 holds the evaluation of the initial weights. On resume from the checkpoint of step N the
file is cut back to steps <= N (atomically, one record per step), because later steps are trained
again, and TensorBoard purges its events from step N+1 on; the logger refuses a step that is not
after the last one recorded, so the final file has each step exactly once. An evaluation that
finishes steps later is added to the record of the step whose weights it measured (`amend`): it is
appended as an amendment line, `{"step": N, "time": unix_s, "amend": true, "eval/...": value}`,
which `read_metrics` merges into step N's record (the record keeps its own time), so amending costs
one appended line however long the run, never a rewrite; TensorBoard gets the keys at that step.
Readers of the raw file merge the same way (e.g. pandas: group by step, take the last value of each
key). A resume folds the amendments into their records when it cuts the file back.

Multi-turn runs add per-episode means under `agent/` (turns, tool_calls, tool_errors, success,
generate_time_s vs env_time_s, reset_time_s, sandbox_start_s, branches; see
miles/rollout/producer.py), shown in the progress bar and in the `agent` and `agent_time` plots.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
AMEND = "amend"
"""The key that marks an amendment line (metrics of an earlier step, merged into its record)."""


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every complete record of metrics.jsonl, with its amendments merged in (a torn last line after
    a crash is skipped); an amendment of a step without a record makes one, in step order."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    records, amends = [], []
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        (amends if isinstance(r, dict) and r.get(AMEND) else records).append(r)
    if not amends:
        return records
    newest = {r.get("step"): r for r in records if isinstance(r, dict)}
    made = False
    for a in amends:
        if (base := newest.get(a.get("step"))) is None:
            base = newest[a.get("step")] = {"step": a.get("step"), "time": a.get("time")}
            records.append(base)
            made = True
        base.update({k: v for k, v in a.items() if k not in ("step", "time", AMEND)})
    if made:
        records.sort(key=lambda r: r.get("step", 0) if isinstance(r, dict) else 0)  # stable
    return records


def truncate_metrics(run_dir: str | Path, last_step: int) -> int:
    """Keep one record per step <= last_step (the last one written), in step order (atomic rewrite);
    returns how many were kept."""
    path = Path(run_dir) / METRICS_FILE
    records = [r for r in read_metrics(run_dir) if isinstance(r, dict) and "step" in r]
    by_step = {int(r["step"]): r for r in records if int(r["step"]) <= last_step}
    kept = [by_step[s] for s in sorted(by_step)]
    tmp = path.with_name(METRICS_FILE + ".tmp")
    with open(tmp, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in kept))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(kept)


class MetricsLogger:
    """Writes one record per step to metrics.jsonl and, optionally, TensorBoard.

    `resume_step=N` continues a run resumed from the checkpoint of step N (records after N are cut
    off); None starts a fresh file."""

    def __init__(self, run_dir: str | Path, tensorboard: bool = True, resume_step: int | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        truncate_metrics(self.run_dir, -1 if resume_step is None else resume_step)
        self.last_step = max((int(r["step"]) for r in read_metrics(self.run_dir)), default=-1)
        """The newest step recorded; `log` accepts only later ones."""
        self._file = open(self.run_dir / METRICS_FILE, "a")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = None if resume_step is None else resume_step + 1  # TensorBoard drops steps >= purge
            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=purge)
        from miles.wandb_sink import with_wandb

        # W&B beside TensorBoard when RUN_DIR/plan.yaml enables observe.wandb (miles/wandb_sink.py)
        self._tb = with_wandb(self._tb, self.run_dir, resume_step)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Append the record of `step` and make it durable before returning."""
        if step <= self.last_step:
            raise ValueError(
                f"metrics of step {step} after step {self.last_step} in {self.run_dir / METRICS_FILE}: "
                "each step is recorded once, in order"
            )
        self.last_step = step
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        record = {"step": step, "time": time.time(), **clean}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        if self._tb is not None:
            for k, v in clean.items():
                if math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()

    def amend(self, step: int, metrics: dict[str, float]) -> None:
        """Add `metrics` to the record of `step` <= the last step logged: an amendment line, appended
        and made durable before returning (see the module docstring)."""
        if step > self.last_step:
            raise ValueError(f"amend: step {step} is after the last step logged ({self.last_step}); use log")
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        record = {"step": step, "time": time.time(), AMEND: True, **clean}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        if self._tb is not None:
            for k, v in clean.items():
                if math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


class ProgressBar:
    """A live progress bar fed from metrics.jsonl: call `update()` as often as you like (`miles train`
    calls it from its supervision loop), `close()` at the end."""

    def __init__(self, run_dir: str | Path, total_steps: int) -> None:
        from tqdm import tqdm

        self.run_dir = run_dir
        self.bar = tqdm(total=total_steps, desc="train", unit="step", dynamic_ncols=True)
        self.seen = 0

    def update(self) -> None:
        records = read_metrics(self.run_dir)
        steps = [r for r in records if r.get("step", 0) > 0]
        if not steps:
            return
        last = steps[-1]
        self.bar.update(max(0, int(last["step"]) - self.seen))
        self.seen = max(self.seen, int(last["step"]))
        post = {"reward": f"{last.get('rollout/reward_mean', float('nan')):.3f}"}
        if "agent/turns" in last:  # multi-turn episodes: success, turns, tool calls and errors per episode
            post["success"] = f"{last.get('agent/success', float('nan')):.2f}"
            post["turns"] = f"{last['agent/turns']:.1f}"
            post["tools"] = (
                f"{last.get('agent/tool_calls', 0.0):.1f}/{last.get('agent/tool_errors', 0.0):.1f}err"
            )
        evals = [r for r in records if "eval/pass@1" in r]
        if evals:
            post["eval_pass@1"] = f"{evals[-1]['eval/pass@1']:.3f}"
        self.bar.set_postfix(post)

    def close(self) -> None:
        self.bar.close()


_PANELS: dict[str, list[str]] = {
    "reward": ["rollout/reward_mean"],
    "eval": ["eval/pass@1", "eval/pass@k"],
    "response": ["rollout/response_len_mean", "rollout/truncated_frac"],
    "mismatch": ["train/logprob_mismatch", "train/tis_clip_frac", "train/tis_clip_seq_frac"],
    "staleness": ["staleness/mean", "staleness/max"],
    "throughput": ["rollout/tokens_per_s"],
    "time": ["time/rollout_s", "time/train_s", "time/sync_s", "time/eval_s"],
    "loss": ["train/loss", "train/entropy"],
    "agent": ["agent/success", "agent/turns", "agent/tool_calls", "agent/tool_errors", "agent/branches"],
    "agent_time": [
        "agent/generate_time_s",
        "agent/env_time_s",
        "agent/reset_time_s",
        "agent/sandbox_start_s",
    ],
}


def _summary(records: list[dict[str, Any]], run_name: str, path: Path) -> bool:
    """One figure for a README: batch reward (and its 10-step mean) beside held-out pass@1 / pass@k."""
    import matplotlib.pyplot as plt

    rewards = [(r["step"], r["rollout/reward_mean"]) for r in records if "rollout/reward_mean" in r]
    evals = [
        (r["step"], r["eval/pass@1"], r.get("eval/pass@k", r["eval/pass@1"]))
        for r in records
        if "eval/pass@1" in r
    ]
    if not rewards or not evals:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    xs, ys = zip(*rewards, strict=True)
    smooth = [sum(ys[max(0, i - 9) : i + 1]) / len(ys[max(0, i - 9) : i + 1]) for i in range(len(ys))]
    left.plot(xs, ys, alpha=0.3, label="batch reward")
    left.plot(xs, smooth, label="10-step mean")
    left.set_title(f"{run_name}: training reward")
    es, p1, pk = zip(*evals, strict=True)
    right.plot(es, p1, marker="o", label="pass@1")
    right.plot(es, pk, marker="o", label="pass@k")
    right.set_title(f"{run_name}: held-out eval")
    for ax in (left, right):
        ax.set_xlabel("step")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def eval_progress(records: list[dict]) -> str:
    """`held-out eval/pass@1 A (step a) -> B (step b)` of a run's records ("" without evaluations): the
    task's held-out prompts (`eval/held_out/pass@1`) where the run evaluates several datasets, whose
    `eval/pass@1` is their mean."""
    key = "eval/held_out/pass@1"
    if not any(isinstance(r.get(key), (int, float)) for r in records):
        key = "eval/pass@1"
    evals = [r for r in records if isinstance(r.get(key), (int, float))]
    if not evals:
        return ""
    first, last = evals[0], evals[-1]
    return (
        f"held-out eval/pass@1 {first[key]:.3f} (step {first['step']}) -> "
        f"{last[key]:.3f} (step {last['step']})"
    )


def run_summary(run_dir: str | Path) -> str:
    """One line on a run: its held-out pass@1 first -> last, its steps and wall time (first to last
    record), and where its plots are."""
    records = read_metrics(run_dir)
    times = [r["time"] for r in records if isinstance(r.get("time"), (int, float))]
    minutes = (max(times) - min(times)) / 60 if times else 0.0
    steps = max((r["step"] for r in records), default=0)
    parts = [
        eval_progress(records),
        f"{steps} steps in {minutes:.1f} min",
        f"plots in {Path(run_dir) / 'plots'}",
    ]
    return f"miles: {run_dir}: " + "; ".join(p for p in parts if p)


def plot_run(run_dir: str | Path) -> list[str]:
    """Write summary.png and one PNG per panel (reward, eval, ...) into RUN_DIR/plots; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    if not records:
        raise FileNotFoundError(
            f"{Path(run_dir) / METRICS_FILE} has no records; is {run_dir} a run directory?"
        )
    out_dir = Path(run_dir) / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = (
        [str(out_dir / "summary.png")]
        if _summary(records, Path(run_dir).name, out_dir / "summary.png")
        else []
    )
    for panel, keys in _PANELS.items():
        series = {k: [(r["step"], r[k]) for r in records if k in r] for k in keys}
        series = {k: v for k, v in series.items() if v}
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for key, points in series.items():
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, label=key)
        ax.set_xlabel("step")
        ax.set_title(f"{Path(run_dir).name}: {panel}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{panel}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(str(path))
    return paths
