"""What is generated each step, how, and how it is scored and buffered."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from miles.config.base import ConfigError, Section
from miles.config.profile import ContainerSandboxConfig


class TaskConfig(Section):
    """Where prompts and answers come from."""

    name: str = "digits"
    """Built-in task (`digits`, `jsonl`, `reasoning_gym`); see miles/rollout/tasks.py."""
    path: str | None = None
    """Dataset file (JSONL or Parquet) for the `jsonl` task; rows need `prompt` and `answer`."""
    prompt_key: str = "prompt"
    """Column holding the prompt."""
    answer_key: str = "answer"
    """Column holding the reference answer."""
    options: dict[str, str | int | float | bool] = Field(default_factory=dict)
    """Task-specific options (e.g. the reasoning-gym dataset name and its size)."""
    eval_size: int = 64
    """Held-out prompts for evaluation (disjoint from training prompts)."""


class EnvConfig(Section):
    """The environment that plays multi-turn episodes (with `rollout.generate_fn` or `rollout.agent_fn`)."""

    name: str | None = None
    """Environment name (`calculator`, `guess`, ...) or `module:Class`; see miles/agentic/envs."""
    options: dict[str, str | int | float | bool] = Field(default_factory=dict)
    """Keyword arguments of the environment's constructor."""
    sandbox: ContainerSandboxConfig | None = None
    """Where the environment's episode sandboxes run, for environments that name the option it goes
    to (`sandbox_option`; harbor: `backend`): None, bubblewrap on this host; {runtime: apptainer |
    enroot, ...}, a container runtime of the cluster's nodes (Harbor: each task's own image).
    `miles submit` sets it from the profile's `container.sandbox` unless the recipe does."""
    max_turns: int | None = None
    """Cap on assistant turns per episode (None: the environment's own `max_turns`)."""
    render_tools: bool = True
    """Offer the environment's tools to the chat template (`tools=`); tiny models with a compact call
    syntax turn it off to keep prompts short."""
    max_episode_tokens: int = 1024
    """Cap on an episode's tokens after the prompt (model turns plus observations); past it the
    episode ends truncated. `rollout.max_new_tokens` caps each turn."""
    demonstrations: int = Field(default=0, ge=0)
    """Per training group, this many episodes are played by the environment's own demonstration
    (its `demonstration(task)` turns, e.g. a Harbor task's solution/solve.sh as one bash call) instead
    of the model: off-policy guidance for tasks a policy would never solve by chance. Their tokens are
    trained with the group's advantages like any sample, with the current policy's log-probs (one
    scoring call to the engine per turn); held-out episodes never get one. 0: none."""

    @field_validator("options", mode="before")
    @classmethod
    def _scalar_options(cls, options: object) -> object:
        if isinstance(options, dict):
            for key, value in options.items():
                if isinstance(value, (dict, list)):
                    where = " (a sandbox backend goes in rollout.env.sandbox)" if key == "backend" else ""
                    raise ValueError(f"option {key!r} must be a string, number or boolean{where}")
        return options


class RolloutConfig(Section):
    """Generation for training."""

    task: TaskConfig = TaskConfig()
    reward: str = "miles.rollout.rewards:exact_match"
    """Reward function as `module:function` (dotted path); built-ins live in miles/rollout/rewards.py."""
    generate_fn: str | None = None
    """Per-sample generate function as `module:function` (None: one single-turn /generate per
    sample). It owns the sample's tokens and may call the engine many times; the built-in
    `miles.agentic.rollout:env_generate` plays `rollout.env` episodes at the token level."""
    agent_fn: str | None = None
    """Agent function as `module:function`: given a task and an OpenAI `base_url` of the session
    server, it runs the episode with any client library and returns a reward; the samples are the
    session server's token records (miles/agentic/rollout.py). `miles.agentic.program:program_agent`
    runs an external program as the agent."""
    agent_options: dict[str, str | int | float | bool] = Field(default_factory=dict)
    """Keyword arguments of agent_fn (e.g. program_agent's `command`, `timeout_s`, `reward_fn`)."""
    env: EnvConfig = EnvConfig()
    prompts_per_step: int = 16
    """Prompt groups per training step."""
    n_samples_per_prompt: int = 8
    """Samples per prompt (the group of GRPO)."""
    temperature: float = 1.0
    """Sampling temperature."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    top_k: int = -1
    """Top-k sampling (-1: off)."""
    max_new_tokens: int = 16
    """Cap on response length in tokens."""
    max_concurrency_per_engine: int = 64
    """Samples in flight per engine."""
    group_requests: bool = False
    """Send a group's samples as one batched /generate request: far less HTTP overhead for short
    responses, but a group's slots free together (the default sends one request per sample, so each
    finished sample frees its slot at once)."""
    schedule: Literal["sync", "async"] = "async"
    """`sync`: generate a batch, train, sync weights. `async`: a producer keeps samples in flight."""
    max_staleness: int = 1
    """Groups generated more than this many weight versions ago go to the staleness policy."""
    buffer_policy: str = "keep"
    """Buffer policy name (keep, drop_stale, retry_stale, dynamic_sampling) or `module:function`."""
    buffer_capacity_groups: int | None = None
    """Bound of the buffer in groups (default: 2 x prompts_per_step)."""
    max_masked_groups: int = Field(default=64, ge=0)
    """Groups in a row with every sample masked (unscorable: e.g. an environment's verifier that
    crashes or times out) after which the run stops, naming the reason; 0: never stop."""

    @model_validator(mode="after")
    def _one_plugin_level(self) -> RolloutConfig:
        if self.agent_fn is not None and self.generate_fn is not None:
            raise ConfigError(
                "rollout.agent_fn and rollout.generate_fn are both set: an agent function brings its own "
                "generation (through the session server); unset one of them"
            )
        return self
