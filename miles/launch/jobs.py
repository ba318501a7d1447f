"""submitit, extended for what it lacks: heterogeneous jobs and pre-rendered scripts.

submitit (1.5) tracks jobs through sacct and owns their stdout paths and cancel, but renders only
homogeneous scripts. `ScriptExecutor` hands sbatch our own rendered text and returns submitit's
own job objects: a `HetSlurmJob` for a het job (sacct lists its components as `ID+0`, `ID+1`,
folded back into `ID`), plain `SlurmJob`s `ID_i` for the tasks of an array. State, stdout and
cancel therefore work exactly as for any submitit job.
"""

from __future__ import annotations

import typing as tp
from collections import defaultdict
from pathlib import Path

from submitit.core import utils as submitit_utils
from submitit.slurm.slurm import SlurmExecutor, SlurmInfoWatcher, SlurmJob

from miles.cluster.environment import inherited_slurm_variables

# Worst first: the state shown for a het job is its worst component's.
_SEVERITY = (
    "FAILED",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "TIMEOUT",
    "CANCELLED",
    "PREEMPTED",
    "REQUEUED",
    "RUNNING",
    "COMPLETING",
    "PENDING",
    "COMPLETED",
)


def _severity(state: str) -> int:
    for i, name in enumerate(_SEVERITY):
        if state.startswith(name):
            return i
    return len(_SEVERITY)


class HetInfoWatcher(SlurmInfoWatcher):
    """sacct watcher that also answers for a het job's id by folding its `ID+k` component rows."""

    def read_info(self, string: bytes | str) -> dict[str, dict[str, str]]:
        info = super().read_info(string)
        components: dict[str, list[dict[str, str]]] = defaultdict(list)
        for key, stats in info.items():
            head, plus, _ = key.partition("+")
            if plus:
                components[head].append(stats)
        for head, rows in components.items():
            info[head] = min(rows, key=lambda s: _severity(s.get("State", "")))
        return info


class HetSlurmJob(SlurmJob[tp.Any]):
    """A submitit job whose id is a het job's leader id."""

    watcher = HetInfoWatcher(delay_s=2)


class ScriptExecutor(SlurmExecutor):
    """Submits a script we rendered ourselves, through submitit's own submission path."""

    job_class = HetSlurmJob

    def __init__(self, folder: str | Path, script: str) -> None:
        super().__init__(folder=folder)
        self._script = script

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        return self._script

    def _num_tasks(self) -> int:
        return 1  # one batch shell: its stdout is the job's log

    def _make_submission_command(self, submission_file_path: Path) -> list[str]:
        # a nested submit must not inherit the enclosing allocation's SLURM_* variables
        unset = [f"--unset={k}" for k in inherited_slurm_variables()]
        return ["env", *unset, "sbatch", str(submission_file_path)]

    def submit_script(self, array_size: int | None = None) -> list[SlurmJob[tp.Any]]:
        """Submit; one job object, or one per array task (ids `ID_i`)."""
        job = self._submit_command("")
        if array_size is None:
            return [job]
        return [
            SlurmJob(folder=self.folder, job_id=f"{job.job_id}_{i}", tasks=[0]) for i in range(array_size)
        ]


def job_object(folder: str | Path, job_id: str) -> SlurmJob[tp.Any]:
    """The submitit job object of a recorded job id (`ID` of a het/single job, `ID_i` of an array task)."""
    cls = SlurmJob if "_" in job_id else HetSlurmJob
    return cls(folder=folder, job_id=job_id, tasks=[0])


def job_state(job: SlurmJob[tp.Any]) -> str:
    """Current state from sacct (forced refresh); UNKNOWN while sacct does not list it yet."""
    return job.get_info(mode="force").get("State") or "UNKNOWN"


FailedSubmissionError = submitit_utils.FailedSubmissionError
