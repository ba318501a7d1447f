"""`miles status|logs|cancel`: look at submitted runs through submitit's job objects.

A run directory remembers its job in RUN_DIR/job.json; a sweep lists its points in
<runs_root>/sweeps/<tag>.json. State comes from sacct (via submitit), last metrics from the last
line of each point's metrics.jsonl. For a run that failed, the batch log names the step that ended
it ("miles: <role> step exited with N"); that role's logs under RUN_DIR/logs give the error shown.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from miles.config import ConfigError

TERMINAL = (
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
)


def job_record(run_dir: str | Path) -> dict[str, Any]:
    path = Path(run_dir) / "job.json"
    if not path.is_file():
        raise ConfigError(
            f"{run_dir} has no job.json: it was not submitted with `miles submit` (or --dry-run)"
        )
    return json.loads(path.read_text())


def last_metrics(run_dir: str | Path) -> dict[str, Any]:
    """The last line of RUN_DIR/metrics.jsonl ({} when there is none yet)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return {}
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    return json.loads(lines[-1]) if lines else {}


ROLE_LOGS = {
    "actor": ("actor-*.log", "trainer-*.log"),
    "rollout": ("rollout-*.log", "engine-*.log", "router.log"),
}
"""Logs of each role under RUN_DIR/logs, in the order they are searched for the error."""
ERROR_LINES = 12
_STEP_EXIT = re.compile(r"^miles: (\w+) step exited with (\d+)(.*)$", re.MULTILINE)


def error_excerpt(text: str, lines: int = ERROR_LINES) -> str | None:
    """The last `lines` lines of the last Python traceback in `text` (None when there is none)."""
    rows = [r for r in text.splitlines() if r.strip()]
    starts = [i for i, r in enumerate(rows) if "Traceback (most recent call last)" in r]
    return "\n".join(rows[starts[-1] :][-lines:]) if starts else None


def failure(run_dir: str | Path, batch_log: str) -> dict[str, Any] | None:
    """{role, exit_code, log, error} of the step that failed the job, from the batch log and the
    role's own logs (the first one holding a traceback, else the first non-empty one); None when no
    step exited non-zero."""
    ends = [(m[1], int(m[2]), m[3]) for m in _STEP_EXIT.finditer(batch_log)]
    # a step that ends before the actor step fails the job (exit 1) even when it exited with 0
    failed = [(role, code or 1) for role, code, rest in ends if code != 0 or "before the actor step" in rest]
    if not failed:
        return None
    role, code = failed[-1]
    logs = [
        f
        for pattern in ROLE_LOGS.get(role, (f"{role}-*.log",))
        for f in sorted((Path(run_dir) / "logs").glob(pattern))
    ]
    texts = {f: f.read_text(errors="replace") for f in logs if f.stat().st_size}
    for f, text in texts.items():
        if (excerpt := error_excerpt(text)) is not None:
            return {"role": role, "exit_code": code, "log": str(f), "error": excerpt}
    f, text = next(iter(texts.items()), (Path(run_dir) / "logs", ""))
    tail = "\n".join([r for r in text.splitlines() if r.strip()][-ERROR_LINES:])
    return {"role": role, "exit_code": code, "log": str(f), "error": tail}


def format_failure(run_dir: str | Path, fail: dict[str, Any]) -> str:
    """Which role failed, the last lines of its error and where its log is."""
    body = "\n".join(f"  | {line}" for line in fail["error"].splitlines()) or "  | (its logs are empty)"
    return (
        f"{run_dir}: the {fail['role']} step failed (exit {fail['exit_code']}); "
        f"last lines of {fail['log']}:\n{body}"
    )


def local_status(run_dir: str | Path) -> dict[str, Any]:
    """The row of a run of `miles train` (no job.json): RUNNING while a live process holds its lock,
    else COMPLETED when its metrics reached train.steps, else STOPPED (resume it with --resume)."""
    from miles.launch.rundir import current_owner, planned_steps

    run_dir = Path(run_dir)
    if not (run_dir / "plan.yaml").is_file():
        raise ConfigError(
            f"{run_dir} has no plan.yaml: it is not a run directory of `miles train` or `submit`"
        )
    metrics = last_metrics(run_dir)
    owner = current_owner(run_dir)
    if owner is not None:
        state = "RUNNING"
    else:
        planned = planned_steps(run_dir)
        state = "COMPLETED" if planned is not None and metrics.get("step", -1) >= planned else "STOPPED"
    job = f"local (pid {owner.pid})" if owner is not None else "local"
    return {"run_dir": str(run_dir), "job_id": job, "state": state, "metrics": metrics}


def run_status(run_dir: str | Path) -> dict[str, Any]:
    """{run_dir, job_id, state, metrics} of one run, and `failure` (see `failure`) when its Slurm
    job ended in any state but COMPLETED; a run of `miles train` is described by `local_status`."""
    from miles.launch.jobs import job_object, job_state

    if not (Path(run_dir) / "job.json").is_file() and (Path(run_dir) / "plan.yaml").is_file():
        return local_status(run_dir)
    rec = job_record(run_dir)
    job = job_object(rec["log_dir"], rec["job_id"])
    state = job_state(job)
    row = {"run_dir": str(run_dir), "job_id": rec["job_id"], "state": state, "metrics": last_metrics(run_dir)}
    if state.startswith(TERMINAL) and state != "COMPLETED":
        row["failure"] = failure(run_dir, job.stdout() or "")
    return row


def sweep_status(runs_root: str | Path, tag: str) -> list[dict[str, Any]]:
    """One row per point of sweep `tag`."""
    path = Path(runs_root) / "sweeps" / f"{tag}.json"
    if not path.is_file():
        known = sorted(p.stem for p in path.parent.glob("*.json"))
        raise ConfigError(f"no sweep {tag!r} under {path.parent}; known tags: {', '.join(known) or 'none'}")
    points = json.loads(path.read_text())["points"]
    return [{**run_status(p["run_dir"]), "point": " ".join(p["overrides"])} for p in points]


def format_table(rows: list[dict[str, Any]]) -> str:
    """Fixed-width table; a summary line when every row is in a terminal state."""
    header = ["job", "state", "step", "point / run", "last metrics"]
    body = []
    for r in rows:
        m = dict(r["metrics"])
        step = str(m.pop("step", "-"))
        shown = ", ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in list(m.items())[:4]
        )
        body.append([r["job_id"], r["state"], step, r.get("point") or r["run_dir"], shown])
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body, strict=False)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)) for row in [header, *body]]
    if rows and all(r["state"].startswith((*TERMINAL, "STOPPED")) for r in rows):
        done = sum(r["state"] == "COMPLETED" for r in rows)
        lines.append(f"summary: {done}/{len(rows)} completed")
    lines += [format_failure(r["run_dir"], r["failure"]) for r in rows if r.get("failure")]
    return "\n".join(lines)


def run_logs(run_dir: str | Path, role: str | None = None) -> str:
    """The batch shell's stdout (via submitit) and, with `role`, that role's step logs."""
    from miles.launch.jobs import job_object

    if role:
        files = sorted((Path(run_dir) / "logs").glob(f"{role}-*.log"))
        return "\n".join(f"==> {f} <==\n{f.read_text()}" for f in files)
    rec = job_record(run_dir)
    text = job_object(rec["log_dir"], rec["job_id"]).stdout() or ""
    fail = failure(run_dir, text)
    return text + ("\n" + format_failure(run_dir, fail) if fail else "")


def cancel(run_dir: str | Path) -> str:
    """Cancel the run's job (the whole het job, or this one array task); returns its id."""
    from miles.launch.jobs import job_object

    rec = job_record(run_dir)
    job_object(rec["log_dir"], rec["job_id"]).cancel(check=True)
    return rec["job_id"]
