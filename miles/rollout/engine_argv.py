"""The embedded engine's model flags for a plan: its weight contract (miles/train/quant.py), LoRA,
speculative decoding and deterministic inference."""

from __future__ import annotations

from typing import Any

from miles.quant.contract import engine_quant_argv


def lora_slots(lora: Any) -> int:
    """Adapter slots a LoRA run's engines keep: one per adapter it trains (every slot of the bank is
    multiplied at every step, so a bank no larger than needed decodes fastest: bench/RESULTS.md)."""
    return len(lora.names)


def engine_lora_argv(plan: Any) -> list[str]:
    """--enable-lora with room for the run's adapter (train.lora); none without LoRA training."""
    lora = plan.train.lora
    if lora is None:
        return []
    return [
        "--enable-lora",
        "--max-lora-rank",
        str(lora.rank),
        "--lora-target-modules",
        *lora.target_modules,
        "--max-loras-per-batch",
        str(lora_slots(lora)),
    ]


def engine_argv(plan: Any) -> list[str]:
    spec = plan.engine.speculative
    own = ["--speculative-max-batch", str(spec.max_batch)] if spec is not None and spec.max_batch else []
    if spec is not None and not spec.adaptive:
        own.append("--no-speculative-adaptive")
    return (
        engine_quant_argv(plan)
        + engine_lora_argv(plan)
        + speculative_argv(plan)
        + own  # the embedded engine's own switches (engine.speculative.max_batch, adaptive)
        + true_on_policy_argv(plan)
    )


def true_on_policy_argv(plan: Any) -> list[str]:
    """SGLang's deterministic-inference flags under train.true_on_policy (the embedded engine takes the
    same: its batch-invariant forward, miles/engine/invariant_forward.py)."""
    if not plan.train.true_on_policy:
        return []
    return ["--enable-deterministic-inference", "--rl-on-policy-target", plan.train.backend]


def speculative_argv(plan: Any) -> list[str]:
    """SGLang's `--speculative-*` flags of engine.speculative (the embedded engine takes the same)."""
    spec = plan.engine.speculative
    if spec is None:
        return []
    argv = ["--speculative-algorithm", spec.algorithm, "--speculative-num-steps", str(spec.num_steps)]
    argv += ["--speculative-eagle-topk", str(spec.eagle_topk)]
    argv += ["--speculative-num-draft-tokens", str(spec.num_draft_tokens or spec.num_steps + 1)]
    if spec.draft_model_path:
        argv += ["--speculative-draft-model-path", spec.draft_model_path]
    return argv
