"""What the dashboard shows of one run directory, read from the files the run writes (never written).

    metrics.jsonl                 curves (one record per step; see miles/metrics.py)
    plan.yaml                     planned steps, trainer ranks, buffer capacity, run name
    rendezvous/engines/*.json     engines of the newest incarnation (miles/cluster/rendezvous.py)
    logs/trainer-<rank>.log       trainer ranks: size, age and last line of each log
    .lock                         whether a process owns the run now (miles/launch/rundir.py)
    job.json                      submitted runs: the Slurm job, its state and its het components
    eval/<dataset>/step_<N>.jsonl recent samples: the newest evaluation's records

Every path a request names is resolved and checked to lie inside the run directory (`inside`), so a
request can never read a file elsewhere (`..`, absolute paths and symbolic links that lead out are
refused alike).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from miles.metrics import METRICS_FILE, read_metrics

PANELS: dict[str, list[str]] = {
    "reward": ["rollout/reward_mean"],
    "eval": ["eval/pass@1", "eval/pass@k"],
    "mismatch": [
        "train/logprob_mismatch",
        "rollout/multi_version_frac",
        "train/tis_clip_frac",
        "train/tis_clip_seq_frac",
    ],
    "staleness": ["staleness/mean", "staleness/max"],
    "lengths": ["rollout/response_len_mean", "rollout/response_len_max", "rollout/truncated_frac"],
    "step time (s)": ["time/rollout_s", "time/train_s", "time/sync_s", "time/eval_s", "time/step_s"],
    "loss": ["train/loss", "train/entropy", "train/kl"],
    "buffer": ["buffer/size", "buffer/retry_queue", "buffer/dropped_stale"],
    "throughput": ["rollout/tokens_per_s", "rollout/samples_per_s"],
    "agent": ["agent/success", "agent/turns", "agent/tool_calls", "agent/tool_errors"],
}
"""Chart title -> the metrics.jsonl keys drawn in it (a chart with none of them is not drawn)."""

SAMPLES_SHOWN = 20
ENGINE_PROBE_S = 0.5
_EVAL_FILE = re.compile(r"^step_(\d+)\.jsonl$")
_TRAINER_LOG = re.compile(r"^trainer-(\d+)\.log$")


class OutsideRunDir(PermissionError):
    """A request named a path outside its run directory."""


def inside(root: Path, relative: str) -> Path:
    """`root / relative`, resolved (symbolic links followed), when it lies inside `root`; else OutsideRunDir."""
    base = root.resolve()
    if not relative or Path(relative).is_absolute() or "\x00" in relative:
        raise OutsideRunDir(f"{relative!r} is not a path relative to the run directory")
    target = (base / relative).resolve()
    if target != base and base not in target.parents:
        raise OutsideRunDir(f"{relative!r} leads outside the run directory")
    return target


def _signature(path: Path) -> str:
    try:
        st = path.stat()
    except FileNotFoundError:
        return "none"
    return f"{st.st_mtime_ns}-{st.st_size}"


class RunView:
    """Read-only view of one run directory, as the dashboard's JSON endpoints serve it."""

    def __init__(self, run_id: str, path: Path) -> None:
        self.id = run_id
        self.path = path.resolve()
        self._slurm_cache: tuple[float, dict[str, Any]] | None = None
        self._records: tuple[str, list[dict[str, Any]]] = ("", [])
        """metrics.jsonl parsed, with the file version it was parsed at (parsed again when it changes)."""

    def describe(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.path.name, "path": str(self.path)}

    def plan(self) -> dict[str, Any]:
        try:
            data = yaml.safe_load((self.path / "plan.yaml").read_text())
        except (OSError, yaml.YAMLError):
            return {}
        return data if isinstance(data, dict) else {}

    def records(self) -> list[dict[str, Any]]:
        """The records of metrics.jsonl, parsed once per version of the file."""
        current = _signature(self.path / METRICS_FILE)
        if self._records[0] != current:
            self._records = (current, read_metrics(self.path))
        return self._records[1]

    def metrics(self, version: str | None = None) -> dict[str, Any]:
        """The curves' records (only the keys some chart draws) and the file's version; records are
        left out when the caller already holds this version (an appended amendment changes it)."""
        current = _signature(self.path / METRICS_FILE)
        if version == current:
            return {"version": current, "unchanged": True}
        wanted = {k for keys in PANELS.values() for k in keys} | {"step", "time", "weights/version"}
        records = [{k: v for k, v in r.items() if k in wanted} for r in self.records()]
        return {"version": current, "unchanged": False, "records": records}

    def state(self) -> dict[str, Any]:
        """Step, weight version, buffer fill, engines, trainer ranks, owner and Slurm job."""
        plan = self.plan()
        records = self.records()
        last = records[-1] if records else {}
        capacity = plan.get("rollout", {}).get("buffer_capacity_groups")
        owner = self._owner()
        return {
            **self.describe(),
            "step": last.get("step"),
            "steps_planned": plan.get("train", {}).get("steps"),
            "weight_version": _last_value(records, "weights/version"),
            "buffer": {"size": last.get("buffer/size"), "capacity": capacity},
            "updated": last.get("time"),
            "owner": owner,
            "engines": self._engines(last, bool(owner["running"])),
            "trainers": self._trainers(plan, bool(owner["running"])),
            "slurm": self._slurm(),
        }

    def _owner(self) -> dict[str, Any]:
        from miles.launch.rundir import current_owner, read_owner

        try:
            live = current_owner(self.path)
        except Exception as e:  # an unreadable lock: show it, the run is not ours to judge
            return {"running": None, "detail": str(e)}
        if live is not None:
            return {"running": True, "detail": live.describe()}
        held = read_owner(self.path)
        return {
            "running": False,
            "detail": f"last owner: {held.describe()}" if held else "no process owns it",
        }

    def _engines(self, last: dict[str, Any], running: bool = True) -> list[dict[str, Any]]:
        """Engines of the newest incarnation that published any, with a health probe each: one that does
        not answer is `not answering` while the run is running, else `stopped` (a finished run)."""
        from miles.cluster.rendezvous import engines_dir, read_engines

        stamps = []
        for p in engines_dir(self.path).glob("*.json"):
            try:
                stamps.append((p.stat().st_mtime, json.loads(p.read_text()).get("incarnation")))
            except (OSError, ValueError):
                continue
        if not stamps:
            return []
        incarnation = max(stamps, key=lambda s: s[0])[1]
        out = []
        for i, rec in enumerate(read_engines(self.path, incarnation)):
            out.append(
                {
                    "url": rec.get("url"),
                    "node": rec.get("node"),
                    "pid": rec.get("pid"),
                    "state": _engine_state(_answers(rec.get("url")), running),
                    "running_reqs": last.get(f"engine/{i}/num_running_reqs"),
                    "waiting_reqs": last.get(f"engine/{i}/num_waiting_reqs"),
                }
            )
        return out

    def _trainers(self, plan: dict[str, Any], running: bool) -> list[dict[str, Any]]:
        """One row per trainer rank: its log's size, age and last line (a rank without a log yet too);
        a rank is `running` while a process owns the run directory, else `stopped`."""
        logs = {}
        for p in (self.path / "logs").glob("trainer-*.log"):
            if m := _TRAINER_LOG.match(p.name):
                logs[int(m.group(1))] = p
        ranks = int(plan.get("train", {}).get("num_ranks") or 0)
        rows = []
        for rank in sorted(set(range(ranks)) | set(logs)):
            p = logs.get(rank)
            if p is None:
                rows.append({"rank": rank, "state": "starting" if running else "no log"})
                continue
            st = p.stat()
            rows.append(
                {
                    "rank": rank,
                    "state": "running" if running else "stopped",
                    "log": str(p.relative_to(self.path)),
                    "log_bytes": st.st_size,
                    "age_s": round(time.time() - st.st_mtime, 1),
                    "last_line": _last_line(p),
                }
            )
        return rows

    def _slurm(self, cache_s: float = 5.0) -> dict[str, Any] | None:
        """The submitted job's state and components (sacct through submitit), at most every `cache_s`."""
        if not (self.path / "job.json").is_file():
            return None
        now = time.monotonic()
        if self._slurm_cache and now - self._slurm_cache[0] < cache_s:
            return self._slurm_cache[1]
        from miles.launch.jobs import HetSlurmJob
        from miles.launch.status import run_status

        try:
            row = run_status(self.path)
            info = getattr(HetSlurmJob.watcher, "_info_dict", {})  # sacct rows of the last query
            row["components"] = [
                {"id": k, "state": v.get("State"), "nodes": v.get("NodeList")}
                for k, v in sorted(info.items())
                if k.startswith(f"{row['job_id']}+")
            ]
            row.pop("metrics", None)
        except Exception as e:  # no sacct on this host, a job sacct forgot: shown, not fatal
            row = {"error": f"{type(e).__name__}: {e}"}
        self._slurm_cache = (now, row)
        return row

    def samples(self, limit: int = SAMPLES_SHOWN) -> dict[str, Any]:
        """The first `limit` records of the newest evaluation of each dataset (eval/<name>/step_<N>.jsonl)."""
        out = []
        for dataset in sorted(p for p in (self.path / "eval").glob("*") if p.is_dir()):
            steps = [(int(m.group(1)), p) for p in dataset.iterdir() if (m := _EVAL_FILE.match(p.name))]
            if not steps:
                continue
            step, path = max(steps)
            rows = []
            with open(path) as f:
                for line in f:
                    if len(rows) >= limit:
                        break
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError:
                        continue
            out.append(
                {
                    "dataset": dataset.name,
                    "step": step,
                    "file": str(path.relative_to(self.path)),
                    "rows": rows,
                }
            )
        return {"id": self.id, "evaluations": out}


def _last_value(records: list[dict[str, Any]], key: str) -> Any:
    for r in reversed(records):
        if key in r:
            return r[key]
    return None


def _last_line(path: Path, tail_bytes: int = 4096) -> str:
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - tail_bytes))
        lines = [x for x in f.read().decode(errors="replace").splitlines() if x.strip()]
    return lines[-1][-300:] if lines else ""


def _engine_state(answers: bool, running: bool) -> str:
    return "serving" if answers else ("not answering" if running else "stopped")


def _answers(url: str | None) -> bool:
    if not url:
        return False
    try:
        return httpx.get(f"{url}/health", timeout=ENGINE_PROBE_S).status_code == 200
    except httpx.HTTPError:
        return False


def run_views(paths: list[str | Path]) -> dict[str, RunView]:
    """id -> view for each run directory (ids are the directory names, numbered when two collide);
    a path that is not a directory is a ValueError naming it."""
    views: dict[str, RunView] = {}
    for raw in paths:
        path = Path(raw)
        if not path.is_dir():
            raise ValueError(f"{raw} is not a run directory (it does not exist or is not a directory)")
        rid, n = path.resolve().name, 1
        while rid in views:
            n += 1
            rid = f"{path.resolve().name}-{n}"
        views[rid] = RunView(rid, path)
    return views
