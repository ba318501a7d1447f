"""JobEnvironment over Slurm / MPI / torchrun variables, node lists, collectives env, GPU detection."""

from __future__ import annotations

from miles.cluster.collectives import collectives_env
from miles.cluster.environment import (
    JobEnvironment,
    expand_nodelist,
    inherited_slurm_variables,
    tasks_per_node,
)
from miles.cluster.hardware import GpuInfo, detect_profile, match_profile, probe_amd, probe_nvidia
from miles.cluster.rendezvous import master_port, publish_engine, read_engines
from miles.config.profile import load_profile

HET = {
    "SLURM_JOB_ID": "41",
    "SLURM_PROCID": "1",
    "SLURM_NTASKS": "2",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "1",
    "SLURMD_NODENAME": "n3",
    "SLURM_STEP_NODELIST": "n[2-3]",
    "SLURM_HET_SIZE": "2",
    "SLURM_JOB_NODELIST_HET_GROUP_0": "n1",
    "SLURM_JOB_NODELIST_HET_GROUP_1": "n[2-3]",
    "SLURM_RESTART_COUNT": "2",
}


def test_nodelists() -> None:
    assert expand_nodelist("gpu[007-009,12],login1") == ["gpu007", "gpu008", "gpu009", "gpu12", "login1"]
    assert expand_nodelist("") == []


def test_het_job_environment() -> None:
    env = JobEnvironment.from_env(HET)
    assert (env.source, env.rank, env.world_size, env.node_name) == ("slurm", 1, 2, "n3")
    assert env.group_nodes(0) == ("n1",) and env.group_nodes(1) == ("n2", "n3")
    assert env.restart_count == 2 and env.job_id == "41"
    assert inherited_slurm_variables(HET) == sorted(HET.keys() - {"SLURMD_NODENAME"})


def test_launcher_precedence() -> None:
    torchrun = JobEnvironment.from_env(
        {**HET, "RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "a", "MASTER_PORT": "5"}
    )
    assert (torchrun.source, torchrun.rank, torchrun.master_port) == ("torchrun", 3, 5)
    mpi = JobEnvironment.from_env({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3"})
    assert (mpi.source, mpi.rank, mpi.world_size) == ("mpi", 2, 3)
    pmix = JobEnvironment.from_env({"PMIX_RANK": "1", "PMI_SIZE": "2"})
    assert (pmix.source, pmix.rank, pmix.world_size) == ("pmi", 1, 2)
    assert JobEnvironment.from_env({}).source == "single"


def test_collectives_env_points_dumps_at_run_logs() -> None:
    env = collectives_env(load_profile("mi355x"), "/runs/x/logs")
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == "/runs/x/logs/flight_recorder-"
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == "/runs/x/logs/flight_recorder-"  # older PyTorch
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and env["TORCH_FR_BUFFER_SIZE"] == "200000"
    assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "200000"  # the older name of the buffer size
    assert env["NCCL_IB_GID_INDEX"] == "1" and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC" not in collectives_env(load_profile("local"), "/l")


def test_rendezvous_records_by_incarnation(tmp_path) -> None:
    publish_engine(tmp_path, "n1-0", "http://127.0.0.1:1", 11, "n1", "5.0")
    publish_engine(tmp_path, "n1-0", "http://127.0.0.1:2", 12, "n1", "5.1")
    publish_engine(tmp_path, "n2-0", "http://127.0.0.1:3", 13, "n2", "5.1")
    assert [r["url"] for r in read_engines(tmp_path, "5.1")] == ["http://127.0.0.1:2", "http://127.0.0.1:3"]
    assert master_port("5") == master_port(5) != master_port(6)


def test_cpu_threads_share_the_task_cpus() -> None:
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1] and tasks_per_node("") == []
    # 8 ranks per node without reserved CPUs: the 112 cores this task sees are shared by 8 tasks
    unbound = JobEnvironment.from_env({**HET, "SLURM_STEP_TASKS_PER_NODE": "8(x2)"})
    assert unbound.tasks_on_node == 8 and unbound.cpu_threads(112) == 14
    # --cpus-per-task=14: each task has its own CPUs, split between the processes it starts
    bound = JobEnvironment.from_env({**HET, "SLURM_CPUS_PER_TASK": "14", "SLURM_STEP_TASKS_PER_NODE": "8"})
    assert bound.cpu_threads(14) == 14 and bound.cpu_threads(14, processes_per_task=2) == 7
    # an exported OMP_NUM_THREADS (the profile's env, or the user's) wins; never fewer than one thread
    assert JobEnvironment.from_env({**HET, "OMP_NUM_THREADS": "1"}).cpu_threads(112) == 1
    assert unbound.cpu_threads(2) == 1


def test_detect_reports_what_the_probes_see() -> None:
    """True on hosts with and without a GPU driver: the answer follows what NVML / amdsmi report."""
    name, reason = detect_profile()
    nvidia, nvidia_why = probe_nvidia()
    assert nvidia_why in reason
    if nvidia is not None:
        assert name == match_profile(nvidia) and all(n in reason for n in nvidia.names)
    else:
        amd, amd_why = probe_amd()
        assert amd_why in reason
        assert name == (match_profile(amd) if amd else None)
        assert amd is not None or "no GPUs seen" in reason


def test_profile_matching() -> None:
    assert match_profile(GpuInfo("nvidia", ("NVIDIA H200",))) == "h200"
    assert match_profile(GpuInfo("nvidia", ("NVIDIA GB300",))) == "gb300"
    assert match_profile(GpuInfo("amd", ("AMD Instinct MI355X",), ("gfx950",))) == "mi355x"
    assert match_profile(GpuInfo("amd", ("",), ("gfx950",))) == "mi355x"
    assert match_profile(GpuInfo("nvidia", ("Tesla T4",))) is None
