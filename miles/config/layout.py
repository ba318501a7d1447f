"""The trainer's parallel layout: what each backend implements and how the sizes must divide the ranks.

`check_layout` holds every layout rule that does not depend on a hardware profile, so that
`miles train` (through resolve(), with the plan's `train.num_ranks`) and `miles submit` (through
miles.launch.spec, with the ranks of the actor group) refuse the same layouts with the same message.
What a profile decides (GPUs per node, partitions, a CPU-only vendor) stays in miles.launch.spec.

The model's shape rules (heads and vocabulary split over tensor-parallel ranks, layers over pipeline
stages, experts over expert-parallel ranks; routing replay needs an MoE model) are checked here when
the model directory already holds its config.json; otherwise the backend checks them when it
starts. Reads JSON only: no torch here.

Expert parallelism (megatron-core's expert grid, expert tensor-parallel size = train.tensor_parallel):
train.expert_parallel divides the data-parallel ranks, ranks / (tensor_parallel x pipeline_parallel),
and the model's routed experts. Megatron trains MoE models without tensor parallelism (its MoE layers
would need sequence parallelism); FSDP shards experts like any parameter (no EP).

Context parallelism: train.context_parallel divides the ranks together with tensor_parallel x
pipeline_parallel, and megatron-core's causal load balancing cuts each sequence into 2 x CP chunks, so
the micro-batch token budget must split into them; no backend builds it yet, so both refuse it after
those rules. Per-backend features: train.recompute is Megatron's only; Megatron offloads optimizer
state to the CPU through megatron-core's hybrid optimizer (bf16 parameters, fp32 moments), and with
`nvme` streams that optimizer's state through train.offload_dir (same rules).

Pipeline stages: layers split evenly, or train.pipeline_first_stage_layers / _last_stage_layers fix
the first / last stage and the rest is split evenly over the stages between (`stage_layers`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from miles.config.base import ConfigError
from miles.config.plan import Plan

log = logging.getLogger("miles.config")

SIZES = ("tensor_parallel", "pipeline_parallel", "expert_parallel", "context_parallel")
"""The parallel sizes of train.*, each 1 when unused."""

UNSUPPORTED: dict[tuple[str, str], str] = {
    ("fsdp", "tensor_parallel"): "FSDP shards every parameter over all train ranks instead; "
    "train.backend=megatron splits layers",
    ("fsdp", "pipeline_parallel"): "FSDP shards every parameter over all train ranks instead; "
    "train.backend=megatron splits layers",
    ("fsdp", "expert_parallel"): "FSDP shards every parameter, experts included, over all train ranks "
    "instead; train.backend=megatron splits experts",
}
"""(train.backend, size) pairs the backend does not implement, and why; any other size may exceed 1."""


def _check_support(plan: Plan) -> None:
    t = plan.train
    for key in SIZES:
        value = getattr(t, key)
        if value < 1:
            raise ConfigError(f"train.{key} must be >= 1 (got {value})")
        why = UNSUPPORTED.get((t.backend, key))
        if value != 1 and why:
            raise ConfigError(
                f"train.{key}={value} is not supported by train.backend={t.backend} ({why}); "
                f"set train.{key}=1"
            )
    for key in ("pipeline_first_stage_layers", "pipeline_last_stage_layers"):
        if getattr(t, key) is not None and t.pipeline_parallel == 1:
            raise ConfigError(
                f"train.{key} sizes a pipeline stage, and train.pipeline_parallel=1 has one stage: unset "
                f"train.{key}, or set train.pipeline_parallel > 1 (train.backend=megatron)"
            )
    if t.backend == "megatron" and t.device == "cpu":
        raise ConfigError(
            "train.backend=megatron runs on CUDA GPUs only (megatron-core's forward is CUDA-only): set "
            "train.device=auto (or cuda), or train.backend=fsdp to train on CPU"
        )


def _check_features(plan: Plan) -> None:
    """What each backend builds of train.recompute and train.optimizer_offload."""
    t = plan.train
    if t.backend == "fsdp" and t.recompute != "none":
        raise ConfigError(
            f"train.recompute={t.recompute} is built for train.backend=megatron only (the FSDP backend "
            "keeps every activation): set train.recompute=none"
        )
    if t.backend != "megatron" or t.optimizer_offload == "none":
        return
    if plan.model.dtype != "bfloat16":
        raise ConfigError(
            f"train.optimizer_offload={t.optimizer_offload} with train.backend=megatron needs "
            f"model.dtype=bfloat16 (got {plan.model.dtype}): megatron-core's CPU optimizer keeps fp32 "
            "master weights of 16-bit parameters only; set model.dtype=bfloat16 or "
            "train.optimizer_offload=none"
        )
    if t.offload_moment_dtype != "fp32":
        raise ConfigError(
            f"train.offload_moment_dtype={t.offload_moment_dtype} is not supported by train.backend=megatron "
            "(megatron-core's CPU optimizer keeps fp32 Adam moments): set train.offload_moment_dtype=fp32"
        )


NO_CONTEXT_PARALLEL: dict[str, str] = {
    "fsdp": "every rank runs whole sequences",
    "megatron": "its attention (miles' SDPAttention without Transformer Engine) sees whole sequences only",
}
"""Backends that do not split sequences over context-parallel ranks, and why."""


def _check_context_parallel(plan: Plan) -> None:
    """Megatron's context parallelism cuts each sequence into 2 x CP chunks (two per rank, for causal
    load balance), so the micro-batch token budget must divide into them; then the backend must build it."""
    t = plan.train
    cp = t.context_parallel
    if cp == 1:
        return
    if t.max_tokens_per_microbatch % (2 * cp):
        raise ConfigError(
            f"train.context_parallel={cp} cuts every sequence into 2 x {cp} chunks, so "
            f"train.max_tokens_per_microbatch={t.max_tokens_per_microbatch} must be a multiple of {2 * cp}: "
            "change one of them"
        )
    why = NO_CONTEXT_PARALLEL.get(t.backend)
    if why:
        raise ConfigError(
            f"train.context_parallel={cp} is not supported yet by train.backend={t.backend} ({why}); "
            "set train.context_parallel=1"
        )


def _check_ranks(plan: Plan, ranks: int, ranks_key: str) -> None:
    t = plan.train
    model_parallel = t.tensor_parallel * t.pipeline_parallel
    if ranks % model_parallel:
        raise ConfigError(
            f"{ranks} trainer ranks ({ranks_key}) are not a multiple of train.tensor_parallel x "
            f"train.pipeline_parallel = {model_parallel}: change {ranks_key} or those sizes"
        )
    if ranks % (model_parallel * t.context_parallel):
        raise ConfigError(
            f"{ranks} trainer ranks ({ranks_key}) are not a multiple of train.tensor_parallel x "
            f"train.pipeline_parallel x train.context_parallel = {model_parallel * t.context_parallel}: "
            f"change {ranks_key} or those sizes"
        )
    data_parallel = ranks // model_parallel
    if data_parallel % t.expert_parallel:
        raise ConfigError(
            f"train.expert_parallel={t.expert_parallel} does not divide the {data_parallel} data-parallel "
            f"ranks ({ranks} trainer ranks ({ranks_key}) / train.tensor_parallel x train.pipeline_parallel "
            f"= {model_parallel}): change train.expert_parallel or {ranks_key}"
        )


def _model_shape(path: str) -> dict[str, int] | None:
    """Layer, head and vocabulary counts from the model's config.json (None when it is not there yet)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    try:
        cfg = json.loads(config.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.path: cannot read {config}: {e}") from None
    cfg = cfg.get("text_config", cfg)
    keys = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size")
    shape = {k: cfg[k] for k in keys if isinstance(cfg.get(k), int)}
    if "num_key_value_heads" not in shape and "num_attention_heads" in shape:
        shape["num_key_value_heads"] = shape["num_attention_heads"]
    # routed experts under the names of Qwen-MoE, DeepSeek and Mixtral configs (0 or absent: dense)
    experts = [cfg.get(k) for k in ("num_experts", "n_routed_experts", "num_local_experts")]
    shape["num_experts"] = next((e for e in experts if isinstance(e, int) and e > 0), 0)
    return shape


def _check_experts(plan: Plan, shape: dict[str, int]) -> None:
    t = plan.train
    experts = shape["num_experts"]
    if t.routing_replay == "rollout" and not experts:
        raise ConfigError(
            f"train.routing_replay=rollout needs a mixture-of-experts model, and model {plan.model.path} "
            "is dense: set train.routing_replay=off"
        )
    if t.expert_parallel > 1 and not experts:
        raise ConfigError(
            f"train.expert_parallel={t.expert_parallel} needs a mixture-of-experts model, and model "
            f"{plan.model.path} is dense: set train.expert_parallel=1"
        )
    if experts and experts % t.expert_parallel:
        raise ConfigError(
            f"model {plan.model.path} has {experts} routed experts, not divisible by "
            f"train.expert_parallel={t.expert_parallel}; choose a train.expert_parallel that divides it"
        )
    if experts and t.backend == "megatron" and t.tensor_parallel > 1:
        raise ConfigError(
            f"train.tensor_parallel={t.tensor_parallel} with mixture-of-experts model {plan.model.path} needs "
            "sequence parallelism, which the Megatron backend does not use: set train.tensor_parallel=1 "
            "and split the experts with train.expert_parallel"
        )


def stage_layers(num_layers: int, stages: int, first: int | None, last: int | None) -> list[int]:
    """Decoder layers per pipeline stage (megatron-core's rule): `first` / `last` fix the end stages
    when given and the rest is split evenly over the other stages. ConfigError when it does not split."""
    fixed = [n for n in (first, last) if n is not None]
    middle_stages = stages - len(fixed)
    rest = num_layers - sum(fixed)
    if rest < 0 or bool(rest) != bool(middle_stages) or (middle_stages and rest % middle_stages):
        if not fixed:
            raise ConfigError(
                f"num_hidden_layers={num_layers}, not divisible by train.pipeline_parallel={stages}: choose a "
                "train.pipeline_parallel that divides it, or size the end stages with "
                "train.pipeline_first_stage_layers / train.pipeline_last_stage_layers"
            )
        raise ConfigError(
            f"num_hidden_layers={num_layers} minus the end stages' {sum(fixed)} (train.pipeline_first_stage_layers"
            f" / train.pipeline_last_stage_layers) leaves {rest}, which does not split evenly over the "
            f"{middle_stages} stage(s) between (train.pipeline_parallel={stages}): change those keys"
        )
    each = rest // middle_stages if middle_stages else 0
    sizes = [each] * stages
    if first is not None:
        sizes[0] = first
    if last is not None:
        sizes[-1] = last
    return sizes


def _check_model(plan: Plan) -> None:
    t = plan.train
    moe = t.expert_parallel > 1 or t.routing_replay != "off"
    if not moe and (t.backend != "megatron" or (t.tensor_parallel == 1 and t.pipeline_parallel == 1)):
        return
    shape = _model_shape(plan.model.path)
    if shape is None:
        log.info(
            "model %s has no config.json yet; its split is checked when the trainer starts", plan.model.path
        )
        return
    _check_experts(plan, shape)
    if t.backend != "megatron":
        return
    skip = ("num_hidden_layers", "num_experts")
    rules = [(k, "train.tensor_parallel", t.tensor_parallel) for k in shape if k not in skip]
    if "num_hidden_layers" in shape:
        first, last = t.pipeline_first_stage_layers, t.pipeline_last_stage_layers
        stage_layers(shape["num_hidden_layers"], t.pipeline_parallel, first, last)
    for what, key, size in rules:
        if what in shape and shape[what] % size:
            raise ConfigError(
                f"model {plan.model.path} has {what}={shape[what]}, not divisible by {key}={size}; "
                f"choose a {key} that divides it"
            )


def _architecture(plan: Plan) -> str | None:
    """`architectures[0]` of the model's config.json, or of the tiny model the run will create; None
    when neither is known yet."""
    config = Path(plan.model.path) / "config.json"
    if config.is_file():
        try:
            archs = json.loads(config.read_text()).get("architectures") or [None]
        except (OSError, ValueError):
            return None  # _model_shape names the unreadable file
        return archs[0]
    if plan.model.init_tiny_if_missing and plan.model.base_recipe is None:
        from miles.models.families import family_of_model_type

        return family_of_model_type(plan.model.tiny.arch).hf_arch
    return None


def _check_family(plan: Plan) -> None:
    """Refuse a model family the chosen trainer or the embedded engine cannot load, naming who can."""
    from miles.models.families import FAMILIES

    family = FAMILIES.get(_architecture(plan) or "")
    if family is None:
        return  # not known yet, or a family outside the registry: the room that loads it decides
    trainers = [b for b in family.backends if b != "engine"]
    if plan.train.backend not in family.backends:
        raise ConfigError(
            f"train.backend={plan.train.backend} cannot load {family.hf_arch} (model {plan.model.path}): "
            f"set train.backend to {' or '.join(trainers)}"
        )
    if plan.engine.kind == "embedded" and not plan.engine.urls and "engine" not in family.backends:
        raise ConfigError(
            f"the embedded engine cannot load {family.hf_arch} (model {plan.model.path}): serve it with "
            "engine.kind=sglang (or engine.urls of servers that do)"
        )


def check_layout(plan: Plan, ranks: int | None = None, ranks_key: str = "train.num_ranks") -> None:
    """Refuse a parallel layout the backend cannot run, naming the key to change.

    `ranks` is the trainer's world size and `ranks_key` the key(s) that set it (`train.num_ranks` for
    local runs, the actor group for Slurm); None checks only the rules that do not depend on it.
    """
    _check_support(plan)
    _check_features(plan)
    if ranks is not None:
        _check_ranks(plan, ranks, ranks_key)
    _check_model(plan)
    _check_family(plan)
    _check_context_parallel(plan)
