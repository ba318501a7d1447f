"""Environment of the collectives library for every rank: NCCL/RCCL settings, watchdog, flight recorder.

PyTorch's NCCL watchdog aborts a rank whose collectives stop progressing for
TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC; with TORCH_NCCL_DUMP_ON_TIMEOUT=1 it first writes the flight
recorder (the last TORCH_FR_BUFFER_SIZE collectives of each rank) to TORCH_FR_DUMP_TEMP_FILE<rank>,
readable with `python -m torch.distributed.flight_recorder.fr_trace`. Buffer size and dump path are
set under both their current and their older names (TORCH_NCCL_TRACE_BUFFER_SIZE,
TORCH_NCCL_DEBUG_INFO_TEMP_FILE), so the dump lands in the run's log dir on old and new PyTorch.
The timeout of each collective is the trainer's `train.collective_timeout_s` (given to the process
group by miles.cluster.distributed); gloo raises in the waiting rank when it passes. Pure: no torch.
"""

from __future__ import annotations

from miles.config.profile import Profile


def collectives_env(profile: Profile, log_dir: str) -> dict[str, str]:
    """Variables for every rank of a job on `profile`; dumps go to `log_dir`/flight_recorder-<rank>."""
    c = profile.collectives
    env: dict[str, str] = {}
    if c.backend in ("nccl", "rccl"):
        env |= {
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
            "TORCH_NCCL_ENABLE_MONITORING": "1",
            "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": str(c.heartbeat_timeout_s),
        }
    if c.flight_recorder_entries > 0:
        dump = f"{log_dir}/flight_recorder-"
        env |= {
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_FR_BUFFER_SIZE": str(c.flight_recorder_entries),
            "TORCH_NCCL_TRACE_BUFFER_SIZE": str(c.flight_recorder_entries),
            "TORCH_FR_DUMP_TEMP_FILE": dump,
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": dump,
        }
    if c.socket_ifname:  # NCCL's syntax; gloo's and TensorPipe's interfaces are derived per rank at
        env["NCCL_SOCKET_IFNAME"] = c.socket_ifname  # start (miles.cluster.network)
    if c.ib_hca:
        env["NCCL_IB_HCA"] = c.ib_hca
    return env | dict(c.env)
