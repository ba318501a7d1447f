"""What the loop builds from a plan, built once before any process starts.

The launcher (`miles train`, `miles submit`) calls `check_inputs` so that a bad task option, dataset
file, reward or plug-in path is a ConfigError naming the key, not a traceback in a trainer's log or a
skipped evaluation at its first step. Imports no torch at import time (login nodes submit).
"""

from __future__ import annotations

from miles.config import ConfigError, Plan


def check_inputs(plan: Plan) -> None:
    """Build the task, load the reward and build what evaluation runs (the eval suites, or the
    external function), so that a bad option, path or function is a ConfigError before any process
    starts (and not a traceback in the trainer's log, or a skipped evaluation at its first step)."""
    from miles.rollout.rewards import load_reward
    from miles.rollout.tasks import plan_task

    task = plan_task(plan)
    load_reward(plan.rollout.reward)
    _check_episode_plugins(plan)
    if not plan.eval.every_steps:
        return
    if plan.eval.mode == "external":
        from miles.eval.runner import load_external

        assert plan.eval.external_fn  # the schema requires it in external mode
        load_external(plan.eval.external_fn)
    else:
        from miles.eval.datasets import build_suites

        build_suites(plan, task)


def _check_episode_plugins(plan: Plan) -> None:
    """The generate or agent function and the environment of multi-turn episodes load."""
    from miles.rollout.generate import load_generate_fn

    r = plan.rollout
    load_generate_fn(r)
    if r.agent_fn is not None:
        from miles.agentic.rollout import load_agent_fn

        load_agent_fn(r.agent_fn)
    if r.env.name is not None:
        from miles.agentic.envs.base import env_options, make_env

        try:
            make_env(r.env.name, **env_options(r.env.name, r.env.options, r.env.sandbox))
        except ValueError as e:
            raise ConfigError(f"rollout.env: {e}") from None
