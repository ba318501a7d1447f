"""recipe + profile + overrides -> one frozen Plan, with every derived value logged.

This is the only place where values are derived. The steps run in order, each small:
merge the layers, validate the schema, fill derived defaults, check cross-section rules and the
trainer's parallel layout (miles.config.layout, the same rules `miles submit` applies to the actor group).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from miles.config.base import ConfigError, explain
from miles.config.engine import check_external_engines, check_speculative
from miles.config.layout import check_layout
from miles.config.loading import apply_overrides, deep_merge, read_yaml
from miles.config.plan import Plan
from miles.config.train import (
    check_distill,
    check_draft,
    check_lora,
    check_quantization,
    check_true_on_policy,
)

log = logging.getLogger("miles.config")


def _derive(plan: Plan) -> dict[str, dict[str, Any]]:
    """Values that follow from others; returned as {section: {key: value}} updates."""
    derived: dict[str, dict[str, Any]] = {"run": {}, "rollout": {}, "train": {}, "model": {}, "weights": {}}
    derived["run"]["runs_root"] = os.path.abspath(plan.run.runs_root)
    if not os.path.isabs(plan.model.path):
        derived["model"]["path"] = os.path.abspath(plan.model.path)
    if plan.rollout.buffer_capacity_groups is None:
        derived["rollout"]["buffer_capacity_groups"] = 2 * plan.rollout.prompts_per_step
    if plan.train.loss.eps_clip_high is None:
        derived["train"]["loss"] = plan.train.loss.model_copy(
            update={"eps_clip_high": plan.train.loss.eps_clip}
        )
    if "transport" not in plan.weights.model_fields_set:
        if plan.train.lora is not None:
            derived["weights"]["transport"] = "lora"  # a LoRA run pushes its adapters alone
        elif plan.launch.layout == "colocated":
            derived["weights"]["transport"] = "tensor"  # NCCL cannot connect two processes on one GPU
    return derived


def _check(plan: Plan) -> None:
    """Cross-section rules; each error names the key to change."""
    r, t = plan.rollout, plan.train
    positive = {
        "rollout.prompts_per_step": r.prompts_per_step,
        "rollout.n_samples_per_prompt": r.n_samples_per_prompt,
        "rollout.max_new_tokens": r.max_new_tokens,
        "rollout.max_concurrency_per_engine": r.max_concurrency_per_engine,
        "engine.num_engines": plan.engine.num_engines,
        "train.num_ranks": t.num_ranks,
        "train.steps": t.steps,
        "weights.update_interval": plan.weights.update_interval,
        "weights.bucket_mb": plan.weights.bucket_mb,
    }
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"{key} must be >= 1 (got {value})")
    if r.max_staleness < 0:
        raise ConfigError(f"rollout.max_staleness must be >= 0 (got {r.max_staleness})")
    if r.buffer_capacity_groups is not None and r.buffer_capacity_groups < r.prompts_per_step:
        raise ConfigError(
            f"rollout.buffer_capacity_groups ({r.buffer_capacity_groups}) must be >= rollout.prompts_per_step "
            f"({r.prompts_per_step}), or the trainer could never take a full batch"
        )
    if t.loss.dual_clip is not None and t.loss.dual_clip <= 1.0:
        raise ConfigError(f"train.loss.dual_clip must be > 1 (got {t.loss.dual_clip})")
    check_external_engines(plan)
    check_speculative(plan)
    check_quantization(plan)
    check_distill(plan)
    check_lora(plan)
    check_true_on_policy(plan)
    check_draft(plan)
    _check_transport(plan)
    if plan.launch.layout == "colocated" and plan.weights.transport == "distributed":
        raise ConfigError(
            "launch.layout=colocated puts engines on the trainer's GPUs, where NCCL cannot broadcast "
            "between them: set weights.transport=tensor (or disk)"
        )
    if t.optimizer_offload == "nvme" and not t.offload_dir:
        raise ConfigError("train.optimizer_offload=nvme needs train.offload_dir (a node-local directory)")


def _check_transport(plan: Plan) -> None:
    """`lora` is the transport of LoRA runs and of them alone."""
    w, lora = plan.weights, plan.train.lora
    if lora is None and w.transport == "lora":
        raise ConfigError("weights.transport=lora pushes LoRA adapters: set train.lora, or another transport")
    if lora is not None and "transport" in w.model_fields_set and w.transport != "lora":
        raise ConfigError(
            f"weights.transport={w.transport}: a train.lora run pushes its adapters alone, through the lora "
            "transport; leave weights.transport unset (or set it to lora)"
        )


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in data.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def resolve(
    recipe: str | Path | dict[str, Any] | None = None,
    overrides: list[str] | None = None,
    profile_defaults: dict[str, Any] | None = None,
) -> Plan:
    """Build the frozen Plan: profile defaults < recipe < overrides, then derive, check, log.

    Without `profile_defaults` the plan runs on this host (`miles train`): the trainer has
    `train.num_ranks` ranks and the layout is checked against them here. `miles submit` passes a
    profile's defaults; there the actor group decides the ranks, and miles.launch.spec checks them with
    the same check_layout once the profile's GPUs per node are known.
    """
    data = read_yaml(recipe) if isinstance(recipe, (str, Path)) else dict(recipe or {})
    if isinstance(recipe, (str, Path)):
        data = _recipe_relative(data, Path(recipe))
    data = deep_merge(profile_defaults or {}, data)
    data = apply_overrides(data, overrides or [])
    try:
        plan = Plan.model_validate(data)
    except ValidationError as e:
        raise explain(
            e, Plan, source=f"recipe {recipe}" if isinstance(recipe, (str, Path)) else "config"
        ) from None
    updates = _derive(plan)
    sections = {k: getattr(plan, k).model_copy(update=v) for k, v in updates.items() if v}
    before = _flatten(plan.model_dump())
    plan = plan.model_copy(update=sections)
    _check(plan)
    check_layout(plan, plan.train.num_ranks if profile_defaults is None else None)
    for key, value in _flatten(plan.model_dump()).items():
        if before.get(key) != value:
            log.info("derived %s = %r", key, value)
    return plan


def _recipe_relative(data: dict[str, Any], recipe: Path) -> dict[str, Any]:
    """A relative `model.base_recipe` names a recipe beside this one: made absolute here."""
    model = data.get("model")
    base = model.get("base_recipe") if isinstance(model, dict) else None
    if isinstance(base, str) and not os.path.isabs(base):
        data = {**data, "model": {**model, "base_recipe": str((recipe.parent / base).resolve())}}
    return data


def write_plan(plan: Plan, path: str | Path) -> None:
    """Write the plan as YAML atomically (write a temp file, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(yaml.safe_dump(plan.model_dump(mode="json"), sort_keys=False))
    os.replace(tmp, path)


RETIRED_KEYS: dict[tuple[str, str], Any] = {("launch", "pipeline_last_stage_layers"): None}
"""Keys plan.yaml files of earlier versions hold at their default, which nothing reads any more."""


def _drop_retired(data: dict[str, Any]) -> dict[str, Any]:
    """A stored plan without its retired keys, so that older run directories can still be resumed."""
    for (section, key), default in RETIRED_KEYS.items():
        values = data.get(section)
        if isinstance(values, dict) and key in values and values[key] == default:
            data = {**data, section: {k: v for k, v in values.items() if k != key}}
    return data


def read_plan(path: str | Path) -> Plan:
    """Read a plan written by write_plan (already resolved; validated again, not re-derived)."""
    data = _drop_retired(read_yaml(path))
    try:
        return Plan.model_validate(data)
    except ValidationError as e:
        raise explain(e, Plan, source=str(path)) from None
