"""`miles status|logs|cancel`: look at submitted runs through submitit's job objects.

A run directory remembers its job in RUN_DIR/job.json; a sweep lists its points in
<runs_root>/sweeps/<tag>.json. State comes from sacct (via submitit), last metrics from the last
line of each point's metrics.jsonl.
"""

from __future__ import annotations

import json
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


def run_status(run_dir: str | Path) -> dict[str, Any]:
    """{run_dir, job_id, state, metrics} of one submitted run."""
    from miles.launch.jobs import job_object, job_state

    rec = job_record(run_dir)
    state = job_state(job_object(rec["log_dir"], rec["job_id"]))
    return {
        "run_dir": str(run_dir),
        "job_id": rec["job_id"],
        "state": state,
        "metrics": last_metrics(run_dir),
    }


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
    if rows and all(r["state"].startswith(TERMINAL) for r in rows):
        done = sum(r["state"] == "COMPLETED" for r in rows)
        lines.append(f"summary: {done}/{len(rows)} completed")
    return "\n".join(lines)


def run_logs(run_dir: str | Path, role: str | None = None) -> str:
    """The batch shell's stdout (via submitit) and, with `role`, that role's step logs."""
    from miles.launch.jobs import job_object

    if role:
        files = sorted((Path(run_dir) / "logs").glob(f"{role}-*.log"))
        return "\n".join(f"==> {f} <==\n{f.read_text()}" for f in files)
    rec = job_record(run_dir)
    return job_object(rec["log_dir"], rec["job_id"]).stdout() or ""


def cancel(run_dir: str | Path) -> str:
    """Cancel the run's job (the whole het job, or this one array task); returns its id."""
    from miles.launch.jobs import job_object

    rec = job_record(run_dir)
    job_object(rec["log_dir"], rec["job_id"]).cancel(check=True)
    return rec["job_id"]
