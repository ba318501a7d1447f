"""Plan + profile -> JobSpec: the checks that run before submission and the layout of roles on groups.

Every check raises ConfigError naming the key to change, before anything reaches Slurm:
node and time limits of the partition, GPUs a profile lacks, a container profile without an
image, parallelism the groups cannot hold (the rules of miles.config.layout, which `miles train` runs
too, over the actor group's ranks). `job_facts` is what the job-side bootstrap needs
besides plan.yaml (written as RUN_DIR/launch.json).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from typing import Any

from miles.cluster.collectives import collectives_env
from miles.config import ConfigError, Plan
from miles.config.layout import check_layout
from miles.config.profile import Profile, check_fp8_formats
from miles.launch.slurm import RUN_DIR, ComponentSpec, JobSpec, StepSpec

log = logging.getLogger("miles.launch")


def engines_per_node(plan: Plan, profile: Profile) -> int:
    """Engine servers on one rollout node (checked: SGLang servers must fit the node's GPUs)."""
    e = plan.engine
    if e.kind == "embedded":
        return plan.launch.engines_per_node or e.num_engines
    if profile.gpus_per_node == 0:
        raise ConfigError(
            f"engine.kind=sglang needs GPUs, but profile {profile.name!r} has none; "
            "set engine.kind=embedded or pick a GPU profile"
        )
    if e.tp_size > profile.gpus_per_node or profile.gpus_per_node % e.tp_size:
        raise ConfigError(
            f"engine.tp_size={e.tp_size} must divide the {profile.gpus_per_node} GPUs per node of profile "
            f"{profile.name!r}; change engine.tp_size"
        )
    if e.dp_size > 1 and e.tp_size % e.dp_size:
        raise ConfigError(f"engine.dp_size={e.dp_size} must divide engine.tp_size={e.tp_size} (DP attention)")
    if e.tp_size % e.ep_size:
        raise ConfigError(f"engine.ep_size={e.ep_size} must divide engine.tp_size={e.tp_size}")
    fit = profile.gpus_per_node // e.tp_size
    n = plan.launch.engines_per_node or fit
    if n > fit:
        raise ConfigError(
            f"launch.engines_per_node={n} servers of engine.tp_size={e.tp_size} need {n * e.tp_size} GPUs; "
            f"profile {profile.name!r} has {profile.gpus_per_node} per node"
        )
    return n


def actor_tasks_per_node(plan: Plan, profile: Profile) -> int:
    """Trainer ranks per actor node (one per GPU by default)."""
    n = plan.launch.actor_tasks_per_node or profile.gpus_per_node or 1
    if profile.gpus_per_node and n > profile.gpus_per_node:
        raise ConfigError(
            f"launch.actor_tasks_per_node={n} exceeds the {profile.gpus_per_node} GPUs per node of profile "
            f"{profile.name!r}"
        )
    return n


def actor_cpus_per_task(plan: Plan, profile: Profile, tasks_per_node: int) -> int:
    """CPUs of each trainer rank's task: launch.cpus_per_task, else an equal share of the node's cores."""
    cpus = plan.launch.cpus_per_task
    if cpus is None:
        return max(1, profile.cpus_per_node // tasks_per_node)
    if cpus < 1 or cpus * tasks_per_node > profile.cpus_per_node:
        raise ConfigError(
            f"launch.cpus_per_task={cpus} x {tasks_per_node} trainer ranks per node must be between 1 and "
            f"the {profile.cpus_per_node} CPUs per node of profile {profile.name!r}; lower launch.cpus_per_task"
        )
    return cpus


def has_eval_group(plan: Plan) -> bool:
    """The job has an eval group of its own: dedicated evaluation of a disaggregated layout."""
    e = plan.eval
    return e.mode == "dedicated" and e.every_steps > 0 and plan.launch.layout == "disaggregated"


def eval_engines_per_node(plan: Plan, profile: Profile) -> int:
    """Eval engines on one node of the eval group: eval.num_engines spread evenly over launch.eval_nodes."""
    n, nodes, e = plan.eval.num_engines, plan.launch.eval_nodes, plan.engine
    if n % nodes:
        raise ConfigError(
            f"eval.num_engines={n} must be a multiple of launch.eval_nodes={nodes} (the same engines on "
            "every eval node); change either"
        )
    per_node = n // nodes
    if e.kind == "sglang" and per_node * e.tp_size > profile.gpus_per_node:
        raise ConfigError(
            f"{per_node} eval engines per node of engine.tp_size={e.tp_size} need {per_node * e.tp_size} "
            f"GPUs; profile {profile.name!r} has {profile.gpus_per_node} per node: raise launch.eval_nodes "
            "or lower eval.num_engines"
        )
    return per_node


def _check_partition(plan: Plan, profile: Profile) -> str | None:
    lc = plan.launch
    partition = lc.partition or profile.partition
    nodes = lc.actor_nodes + (lc.rollout_nodes if lc.layout == "disaggregated" else 0)
    nodes += lc.eval_nodes if has_eval_group(plan) else 0
    limits = profile.partitions.get(partition) if partition else None
    if partition and profile.partitions and limits is None:
        raise ConfigError(
            f"launch.partition={partition!r} is not a partition of profile {profile.name!r}; "
            f"known: {', '.join(sorted(profile.partitions))}"
        )
    max_nodes = limits.max_nodes if limits else profile.max_nodes
    if nodes > max_nodes:
        raise ConfigError(
            f"the job needs {nodes} nodes (launch.rollout_nodes={lc.rollout_nodes} + launch.actor_nodes="
            f"{lc.actor_nodes}{f' + launch.eval_nodes={lc.eval_nodes}' if has_eval_group(plan) else ''}) "
            f"but partition {partition!r} of profile {profile.name!r} allows {max_nodes}; "
            "lower launch.rollout_nodes / launch.actor_nodes / launch.eval_nodes"
        )
    if limits and limits.max_time_min and lc.time_limit_min > limits.max_time_min:
        raise ConfigError(
            f"launch.time_limit_min={lc.time_limit_min} exceeds the {limits.max_time_min} min limit of "
            f"partition {partition!r}; lower launch.time_limit_min"
        )
    return partition


def _check_parallelism(plan: Plan, profile: Profile, ranks: int) -> None:
    """The layout rules `miles train` runs too (miles.config.layout), over the actor group's ranks."""
    check_layout(plan, ranks, "launch.actor_nodes x launch.actor_tasks_per_node")
    if plan.train.backend == "megatron" and profile.vendor == "cpu":
        raise ConfigError(f"train.backend=megatron needs GPUs; profile {profile.name!r} has none")


def container_image(plan: Plan, profile: Profile) -> str | None:
    """The image every step runs in, or None when the profile runs without containers."""
    if not profile.container.enabled:
        return None
    image = plan.launch.container_image or profile.container.image
    if not image:
        raise ConfigError(
            f"profile {profile.name!r} runs steps in a container but names no image; set "
            f"container.image in its YAML or launch.container_image (see containers/README.md)"
        )
    return image


def check(plan: Plan, profile: Profile) -> dict[str, Any]:
    """All pre-submission checks; returns the derived layout facts (logged) for job_facts."""
    lc = plan.launch
    if plan.engine.urls:
        raise ConfigError(
            "engine.urls points `miles train` at SGLang servers already running; a Slurm job starts its own "
            "servers on its rollout nodes: remove engine.urls"
        )
    for key in ("rollout_nodes", "actor_nodes", "eval_nodes", "time_limit_min", "array_parallelism"):
        if getattr(lc, key) < 1:
            raise ConfigError(f"launch.{key} must be >= 1 (got {getattr(lc, key)})")
    partition = _check_partition(plan, profile)
    tasks = actor_tasks_per_node(plan, profile)
    _check_parallelism(plan, profile, lc.actor_nodes * tasks)
    check_fp8_formats(
        profile,
        {"engine.quantization": plan.engine.quantization, "train.quantization": plan.train.quantization},
        emulate=plan.engine.kind == "embedded",
    )
    actor_cpus_per_task(plan, profile, tasks)
    per_node = engines_per_node(plan, profile)
    rollout_nodes = lc.rollout_nodes if lc.layout == "disaggregated" else lc.actor_nodes
    facts = {
        "profile": profile.name,
        "layout": lc.layout,
        "partition": partition,
        "actor_ranks": lc.actor_nodes * tasks,
        "actor_tasks_per_node": tasks,
        "engines_per_node": per_node,
        "num_engines": rollout_nodes * per_node,
        "eval_nodes": lc.eval_nodes if has_eval_group(plan) else 0,
        "eval_engines_per_node": eval_engines_per_node(plan, profile) if has_eval_group(plan) else 0,
        "engine_kind": plan.engine.kind,
        "engine_host": profile.engine_host,
        "gpus_per_node": profile.gpus_per_node,
        "bootstrap": profile.bootstrap,
        "container_image": container_image(plan, profile),
    }
    for key, value in facts.items():
        log.info("derived launch.%s = %r", key, value)
    return facts


def container_flags(plan: Plan, profile: Profile, image: str | None, env: dict[str, str]) -> tuple[str, ...]:
    if image is None:
        return ()
    root = plan.run.runs_root
    mounts = [*profile.container.mounts, f"{root}:{root}"]
    flags = [f"--container-image={image}", f"--container-mounts={','.join(mounts)}"]
    if profile.container.workdir:
        flags.append(f"--container-workdir={profile.container.workdir}")
    # listed variables keep the host's value even where the image sets its own
    return (*flags, f"--container-env={','.join(sorted(env))}")


def sized_flags(flags: tuple[str, ...], nodes: int) -> tuple[str, ...]:
    """A profile's sbatch flags for one het component of `nodes` nodes: `--segment=S` (topology/block:
    nodes placed in segments of S) becomes the largest divisor of `nodes` not above S, since Slurm
    refuses a node count that is not a multiple of the segment size (a component of fewer nodes than
    S is one segment, all in one block)."""
    out = []
    for flag in flags:
        if flag.startswith("--segment="):
            size = int(flag.split("=", 1)[1])
            flag = f"--segment={max(d for d in range(1, min(size, nodes) + 1) if nodes % d == 0)}"
        out.append(flag)
    return tuple(out)


def _groups_and_steps(
    plan: Plan, profile: Profile, python: str, actor: ComponentSpec, flags: tuple, common: dict
) -> tuple[tuple[ComponentSpec, ...], tuple[StepSpec, ...]]:
    """The job's het groups and job steps: disaggregated (a rollout group, the actor group, and an
    eval group when the plan has one) or colocated (engines and trainer ranks on the actor nodes)."""
    lc, gpus = plan.launch, profile.gpus_per_node
    boot = (python, "-m", "miles.cluster.bootstrap")
    rollout_argv = (*boot, "rollout", "--run-dir", RUN_DIR)
    actor_argv = (*boot, "actor", "--run-dir", RUN_DIR, "--", python, "-m", lc.actor_module)
    actor_argv += ("--run-dir", RUN_DIR, "--resume")
    mpi = ("--mpi=pmix",) if profile.bootstrap == "mpi" else ()
    node_cpus, rank_cpus = (
        f"--cpus-per-task={profile.cpus_per_node}",
        f"--cpus-per-task={actor.cpus_per_task}",
    )
    if lc.layout != "disaggregated":
        per_node = ("--overlap", f"--nodes={lc.actor_nodes}", "--ntasks-per-node=1", node_cpus)
        steps = (
            StepSpec("rollout", None, rollout_argv, (*per_node, *flags)),
            StepSpec("actor", None, actor_argv, ("--overlap", rank_cpus, *mpi, *flags)),
        )
        return (actor,), steps
    rollout = ComponentSpec(
        "rollout", lc.rollout_nodes, 1, gpus, cpus_per_task=profile.cpus_per_node, **common
    )
    components: tuple[ComponentSpec, ...] = (rollout, actor)
    steps: tuple[StepSpec, ...] = (StepSpec("rollout", 0, rollout_argv, (node_cpus, *flags)),)
    if has_eval_group(plan):
        # group 2: the eval engines; its end (a lost engine) skips evaluations, never ends the job
        eval_group = ComponentSpec(
            "eval", lc.eval_nodes, 1, gpus, cpus_per_task=profile.cpus_per_node, **common
        )
        components += (eval_group,)
        eval_argv = (*boot, "eval", "--run-dir", RUN_DIR)
        steps += (StepSpec("eval", 2, eval_argv, (node_cpus, *flags), fatal=False),)
    steps += (StepSpec("actor", 1, actor_argv, (rank_cpus, *mpi, *flags)),)
    return components, steps


def build_job(
    plan: Plan, profile: Profile, run_dirs: list[str], *, log_dir: str, python: str | None = None
) -> JobSpec:
    """The JobSpec of `plan` on `profile`; one run dir per array task (sweeps), else one.

    `python` runs the job-side entry points: by default this interpreter, or the image's `python`
    when steps run in a container.
    """
    facts = check(plan, profile)
    python = python or ("python" if facts["container_image"] else sys.executable)
    lc = plan.launch
    env = {"PYTHONUNBUFFERED": "1", **profile.env, **collectives_env(profile, f"{RUN_DIR}/logs")}
    flags = (*container_flags(plan, profile, facts["container_image"], env), *profile.srun_flags)
    common = {
        "partition": facts["partition"],
        "constraint": profile.constraint,
        "account": profile.account,
        "flags": tuple(profile.sbatch_flags),
    }
    gpus = profile.gpus_per_node
    # CPU binding from the profile: each trainer rank gets its share of a node's cores, a rollout
    # node's one bootstrap task all of them; said on the srun line too (not every Slurm passes the
    # sbatch value on to steps). The bootstrap derives OMP_NUM_THREADS from SLURM_CPUS_PER_TASK.
    actor_cpus = actor_cpus_per_task(plan, profile, facts["actor_tasks_per_node"])
    actor = ComponentSpec(
        "actor", lc.actor_nodes, facts["actor_tasks_per_node"], gpus, cpus_per_task=actor_cpus, **common
    )
    components, steps = _groups_and_steps(plan, profile, python, actor, flags, common)
    components = tuple(dataclasses.replace(c, flags=sized_flags(c.flags, c.nodes)) for c in components)
    return JobSpec(
        job_name=f"miles-{plan.run.name}" if len(run_dirs) == 1 else f"miles-sweep-{lc.sweep_tag}",
        run_dirs=tuple(run_dirs),
        log_dir=log_dir,
        time_limit_min=lc.time_limit_min,
        components=components,
        steps=steps,
        env=env,
        setup=tuple(profile.setup),
        requeue_signal_s=profile.requeue_signal_s if lc.requeue else None,
        array_parallelism=lc.array_parallelism if len(run_dirs) > 1 else None,
        comment=f"miles-sweep:{lc.sweep_tag}" if lc.sweep_tag else None,
    )
