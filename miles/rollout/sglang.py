"""Command lines of SGLang servers and of the sglang-router, rendered by pure functions.

Flag names follow SGLang's `server_args.py` (`python -m sglang.launch_server --help`) and the
sglang-router CLI. Nothing here runs a process: the job-side bootstrap (miles.cluster.bootstrap)
executes what these functions return, and golden tests pin their text.
"""

from __future__ import annotations

from miles.config import Plan
from miles.rollout.engine_argv import engine_lora_argv, speculative_argv, true_on_policy_argv
from miles.rollout.router import policy_args

# Ports of one job live in [BASE, BASE + SPAN * 1000): derived from the job id so that two jobs on
# one node differ, and every server of a node gets its own slot of PORT_STRIDE ports.
PORT_BASE = 30000
PORT_SPAN = 30
PORT_STRIDE = 3


def sglang_port(job_id: int, local_index: int) -> int:
    """Port of the `local_index`-th SGLang server of a node in job `job_id`."""
    if local_index * PORT_STRIDE >= PORT_SPAN - PORT_STRIDE:
        raise ValueError(f"at most {PORT_SPAN // PORT_STRIDE - 1} servers per node (got index {local_index})")
    return PORT_BASE + (job_id % 1000) * PORT_SPAN + local_index * PORT_STRIDE


def router_port(job_id: int) -> int:
    """Port of the sglang-router of job `job_id` (the last slot of the job's port range)."""
    return PORT_BASE + (job_id % 1000) * PORT_SPAN + PORT_SPAN - 1


def sglang_server_command(
    plan: Plan, *, host: str, port: int, python: str = "python", base_gpu_id: int = 0
) -> list[str]:
    """argv of one SGLang server for this plan: model, TP/DP/EP, memory, batching, R3 capture."""
    e, s = plan.engine, plan.launch.sglang
    cmd = [
        python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        plan.model.path,
        "--host",
        host,
        "--port",
        str(port),
        "--tp-size",
        str(e.tp_size),
        "--dp-size",
        str(e.dp_size),
        "--ep-size",
        str(e.ep_size),
        "--base-gpu-id",
        str(base_gpu_id),
        "--mem-fraction-static",
        str(e.mem_fraction_static),
        "--max-running-requests",
        str(e.max_running_requests),
        "--max-total-tokens",
        str(e.max_total_tokens),
        "--dtype",
        plan.model.dtype,
        "--random-seed",
        str(plan.run.seed),
        "--trust-remote-code",
        "--skip-server-warmup",
    ]
    if e.dp_size > 1:
        cmd.append("--enable-dp-attention")
    if s.context_length is not None:
        cmd += ["--context-length", str(s.context_length)]
    if s.capture_routed_experts or plan.train.routing_replay == "rollout":  # R3 replays the engine's routing
        cmd.append("--enable-return-routed-experts")
    if e.quantization != "none":  # an FP8 checkpoint's own config gives its layout; packed formats need
        cmd += ["--quantization", SGLANG_QUANTIZATION[e.quantization]]  # a packed checkpoint (miles export)
    cmd += engine_lora_argv(plan)  # the run's adapters, pushed each step by name (SGLang's own flags)
    cmd += speculative_argv(plan)  # engine.speculative, in SGLang's own flags
    cmd += true_on_policy_argv(plan)  # train.true_on_policy: batch-invariant kernels matching FSDP
    return cmd + list(s.extra_args)


SGLANG_QUANTIZATION = {
    "fp8_block": "fp8",
    "fp8_row": "fp8",
    "int4": "compressed-tensors",
    "mxfp8": "mxfp8",
    "nvfp4": "modelopt_fp4",
}
"""SGLang's --quantization method for each engine.quantization."""


def router_command(plan: Plan, *, host: str, port: int, worker_urls: list[str]) -> list[str]:
    """argv of the sglang-router in front of `worker_urls`.

    Its Prometheus exporter would otherwise bind a fixed default port (29000) on every host; it takes
    the slot just below the router's own port instead, so jobs sharing a node never collide.
    """
    return [
        "sglang-router",
        "launch",
        "--host",
        host,
        "--port",
        str(port),
        "--prometheus-host",
        host,
        "--prometheus-port",
        str(port - 1),
        *policy_args(plan.engine.router_policy),
        "--worker-urls",
        *worker_urls,
    ]
