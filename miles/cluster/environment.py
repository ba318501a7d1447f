"""JobEnvironment: the ONLY reader of SLURM_*, OMPI_*, PMI_* and torchrun variables.

Every other module asks this class for rank, world size, local rank, node lists and job id.
Sources are tried in order: torchrun (RANK/WORLD_SIZE), Slurm (SLURM_PROCID/SLURM_NTASKS),
Open MPI (OMPI_COMM_WORLD_*), and finally a single process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class JobEnvironment:
    """Typed view of the launcher's variables for this process."""

    source: str
    """Which launcher set the variables: torchrun, slurm, mpi or single."""
    rank: int
    world_size: int
    local_rank: int
    master_addr: str | None
    master_port: int | None
    job_id: str | None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> JobEnvironment:
        e = os.environ if env is None else env
        port = int(e["MASTER_PORT"]) if e.get("MASTER_PORT") else None
        addr = e.get("MASTER_ADDR")
        job = e.get("SLURM_JOB_ID")
        if "RANK" in e and "WORLD_SIZE" in e:
            return cls(
                "torchrun", int(e["RANK"]), int(e["WORLD_SIZE"]), int(e.get("LOCAL_RANK", 0)), addr, port, job
            )
        if "SLURM_PROCID" in e and "SLURM_NTASKS" in e:
            return cls(
                "slurm",
                int(e["SLURM_PROCID"]),
                int(e["SLURM_NTASKS"]),
                int(e.get("SLURM_LOCALID", 0)),
                addr,
                port,
                job,
            )
        if "OMPI_COMM_WORLD_RANK" in e:
            return cls(
                "mpi",
                int(e["OMPI_COMM_WORLD_RANK"]),
                int(e["OMPI_COMM_WORLD_SIZE"]),
                int(e.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)),
                addr,
                port,
                job,
            )
        return cls("single", 0, 1, 0, addr, port, job)

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1
