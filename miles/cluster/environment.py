"""JobEnvironment: the ONLY reader of SLURM_*, OMPI_*, PMI_*/PMIX_* and torchrun variables.

Every other module asks this class for rank, world size, local rank, node lists and job id.
Sources are tried in order: torchrun (RANK/WORLD_SIZE), Slurm (SLURM_PROCID/SLURM_NTASKS),
Open MPI (OMPI_COMM_WORLD_*), PMIx / PMI (PMIX_RANK, PMI_RANK/PMI_SIZE), and finally a single
process. Slurm facts that hold for every source (job id, node lists per het group, restart count,
array index) are read alongside.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field


def expand_nodelist(text: str) -> list[str]:
    """Slurm hostlist -> names: `n[1-3,5],gpu07` -> [n1, n2, n3, n5, gpu07] (zero padding kept)."""
    names: list[str] = []
    for prefix, ranges, suffix, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]([^,]*)|([^,\[\]]+)", text):
        if not ranges:
            names.append(plain)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                names.append(f"{prefix}{str(i).zfill(len(lo))}{suffix}")
    return [n for n in names if n]


def _het_nodelists(e: Mapping[str, str]) -> tuple[tuple[str, ...], ...]:
    size = int(e.get("SLURM_HET_SIZE", 0) or 0)
    return tuple(tuple(expand_nodelist(e.get(f"SLURM_JOB_NODELIST_HET_GROUP_{g}", ""))) for g in range(size))


def _launcher(e: Mapping[str, str]) -> tuple[str, int, int, int]:
    """(source, rank, world_size, local_rank) from the first launcher whose variables are present."""
    if "RANK" in e and "WORLD_SIZE" in e:
        return "torchrun", int(e["RANK"]), int(e["WORLD_SIZE"]), int(e.get("LOCAL_RANK", 0))
    if "SLURM_PROCID" in e and "SLURM_NTASKS" in e:
        return "slurm", int(e["SLURM_PROCID"]), int(e["SLURM_NTASKS"]), int(e.get("SLURM_LOCALID", 0))
    if "OMPI_COMM_WORLD_RANK" in e:
        rank, size = int(e["OMPI_COMM_WORLD_RANK"]), int(e["OMPI_COMM_WORLD_SIZE"])
        return "mpi", rank, size, int(e.get("OMPI_COMM_WORLD_LOCAL_RANK", 0))
    if "PMIX_RANK" in e or "PMI_RANK" in e:
        rank = int(e.get("PMIX_RANK", e.get("PMI_RANK", 0)))
        return "pmi", rank, int(e.get("PMI_SIZE", 1)), int(e.get("MPI_LOCALRANKID", 0))
    return "single", 0, 1, 0


def tasks_per_node(text: str) -> list[int]:
    """Slurm's compressed task counts -> one count per node: `2(x3),1` -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for count, repeat in re.findall(r"(\d+)(?:\(x(\d+)\))?", text):
        counts += [int(count)] * int(repeat or 1)
    return counts


def _tasks_on_node(e: Mapping[str, str]) -> int:
    counts = tasks_per_node(e.get("SLURM_STEP_TASKS_PER_NODE", e.get("SLURM_TASKS_PER_NODE", "")))
    node = int(e.get("SLURM_NODEID", 0))
    return counts[node] if node < len(counts) else 1


def _int_or_none(text: str | None) -> int | None:
    return int(text) if text and text.strip().isdigit() else None


INCARNATION_VAR = "MILES_INCARNATION"
"""Set by `miles train` for the processes it starts (written here, read only by JobEnvironment)."""


@dataclass(frozen=True)
class JobEnvironment:
    """Typed view of the launcher's variables for this process."""

    source: str
    """Which launcher set the variables: torchrun, slurm, mpi, pmi or single."""
    rank: int
    world_size: int
    local_rank: int
    master_addr: str | None
    master_port: int | None
    job_id: str | None
    node_name: str | None = None
    """This node's Slurm name (SLURMD_NODENAME)."""
    node_rank: int = 0
    """Index of this node within the step (SLURM_NODEID)."""
    step_nodes: tuple[str, ...] = ()
    """Nodes of this step (SLURM_STEP_NODELIST, else SLURM_JOB_NODELIST)."""
    het_nodes: tuple[tuple[str, ...], ...] = field(default_factory=tuple)
    """Nodes of each het-job group (SLURM_JOB_NODELIST_HET_GROUP_<n>); empty for homogeneous jobs."""
    restart_count: int = 0
    """How often Slurm requeued this job (SLURM_RESTART_COUNT)."""
    array_task_id: int | None = None
    """Index within a job array (SLURM_ARRAY_TASK_ID)."""
    local_incarnation: str | None = None
    """Incarnation set by `miles train` for its children (MILES_INCARNATION); None under Slurm."""
    cpus_per_task: int | None = None
    """CPUs Slurm reserved for each task of the step (SLURM_CPUS_PER_TASK); None when not asked for."""
    tasks_on_node: int = 1
    """Tasks of this step on this node (SLURM_STEP_TASKS_PER_NODE at SLURM_NODEID)."""
    omp_num_threads: int | None = None
    """OMP_NUM_THREADS as exported (by the user or the profile's env); None when unset."""
    socket_ifname: str | None = None
    """The profile's interface setting as exported for NCCL (NCCL_SOCKET_IFNAME, NCCL's syntax: names,
    prefixes, `^` exclusions); gloo's and TensorPipe's are derived from it (miles.cluster.network)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> JobEnvironment:
        e = os.environ if env is None else env
        source, rank, world, local = _launcher(e)
        port = int(e["MASTER_PORT"]) if e.get("MASTER_PORT") else None
        array = e.get("SLURM_ARRAY_TASK_ID")
        return cls(
            source,
            rank,
            world,
            local,
            e.get("MASTER_ADDR"),
            port,
            e.get("SLURM_JOB_ID"),
            node_name=e.get("SLURMD_NODENAME"),
            node_rank=int(e.get("SLURM_NODEID", 0)),
            step_nodes=tuple(expand_nodelist(e.get("SLURM_STEP_NODELIST", e.get("SLURM_JOB_NODELIST", "")))),
            het_nodes=_het_nodelists(e),
            restart_count=int(e.get("SLURM_RESTART_COUNT", 0) or 0),
            array_task_id=int(array) if array else None,
            local_incarnation=e.get(INCARNATION_VAR) or None,
            cpus_per_task=_int_or_none(e.get("SLURM_CPUS_PER_TASK")),
            tasks_on_node=_tasks_on_node(e),
            omp_num_threads=_int_or_none(e.get("OMP_NUM_THREADS")),
            socket_ifname=e.get("NCCL_SOCKET_IFNAME") or None,
        )

    @property
    def incarnation(self) -> str:
        """Which start of the job this process belongs to; rendezvous records of others are stale.

        Slurm: `<job id>.<restart count>` (a requeue is a new incarnation); `miles train`: the value
        it exported to its children; anything else: "local".
        """
        if self.job_id:
            return f"{self.job_id}.{self.restart_count}"
        return self.local_incarnation or "local"

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def cpu_threads(self, available_cpus: int, processes_per_task: int = 1) -> int:
        """Intra-op threads for each of `processes_per_task` torch processes of this task.

        OMP_NUM_THREADS when exported wins. Else the task's CPUs: SLURM_CPUS_PER_TASK when the job
        reserved them (Slurm binds each task to its own), otherwise the `available_cpus` this process
        may run on shared by the step's tasks on this node. Every torch process defaults to one thread
        per core it sees; several on one node then oversubscribe the cores and spin-wait on each other.
        """
        if self.omp_num_threads:
            return self.omp_num_threads
        cpus = self.cpus_per_task or available_cpus // max(1, self.tasks_on_node)
        return max(1, cpus // max(1, processes_per_task))

    def group_nodes(self, group: int) -> tuple[str, ...]:
        """Nodes of het group `group`; in a homogeneous job, the step's nodes."""
        if self.het_nodes:
            return self.het_nodes[group]
        return self.step_nodes


def inherited_slurm_variables(env: Mapping[str, str] | None = None) -> list[str]:
    """Names of SLURM_* variables inherited from an enclosing allocation (unset before a nested sbatch)."""
    e = os.environ if env is None else env
    return sorted(k for k in e if k.startswith("SLURM_") and k != "SLURM_CONF")


def intra_op_threads(processes_per_task: int = 1, env: Mapping[str, str] | None = None) -> tuple[int, str]:
    """Intra-op threads of each of `processes_per_task` torch processes of this task (the rule of
    JobEnvironment.cpu_threads over the CPUs this process may run on), and where the number comes
    from, for the line every process logs at start: `threads: torch intra-op N (from ...)`."""
    job = JobEnvironment.from_env(env)
    available = len(os.sched_getaffinity(0))
    threads = job.cpu_threads(available, processes_per_task)
    if job.omp_num_threads:
        origin = f"OMP_NUM_THREADS={job.omp_num_threads}"
        origin += f"; the task has SLURM_CPUS_PER_TASK={job.cpus_per_task}" if job.cpus_per_task else ""
        return threads, origin
    if job.cpus_per_task:
        origin = f"SLURM_CPUS_PER_TASK={job.cpus_per_task}"
    else:
        origin = f"{available} usable CPUs / {job.tasks_on_node} task(s) on this node"
    return threads, origin + (f" / {processes_per_task} processes" if processes_per_task > 1 else "")


def set_intra_op_threads(env: Mapping[str, str] | None = None) -> str:
    """Set this torch process's intra-op threads by `intra_op_threads` and return the line to log at
    start (the engine and every trainer rank call it first thing)."""
    import torch

    threads, origin = intra_op_threads(1, env)
    torch.set_num_threads(threads)
    return f"threads: torch intra-op {torch.get_num_threads()} (from {origin})"
