"""Multi-turn generate functions: environment episodes at the token level, and the agent level.

`env_generate` (`rollout.generate_fn: miles.agentic.rollout:env_generate`) plays one episode of
`rollout.env` per sample and builds one token sequence:

    prompt_ids   = the opening messages, rendered by the tokenizer's chat template
    response_ids = turn_1 obs_1 turn_2 obs_2 ... turn_k
    loss_mask    =  1..1  0..0   1..1  0..0  ...  1..1

Each turn is one engine call on everything so far (`rollout.max_new_tokens` new tokens at most); its
output ids, log-probs and per-token weight versions are appended as the engine returned them (mask
1), never re-tokenised. The environment's answer (tool results, feedback) is appended as the chat
template renders it after the assistant turn, tokenised once (mask 0, log-prob 0, the weight version
of the turn before it, so a group's staleness is that of its oldest generated token). The episode
ends when the environment says done, at `rollout.env.max_turns` turns or at
`rollout.env.max_episode_tokens` tokens (then truncated; so does a later turn the engine refuses, e.g.
past its context length). With `rollout.env.demonstrations` = d, the first d samples of each training group are played by
the environment's `demonstration(task)` (a list of assistant turns) instead of the engine: each turn's
text is tokenised (plus the end-of-turn token), scored by the engine for its log-probs under the
current weights, and appended like a generated turn (mask 1); the environment then steps as usual,
so the verifier scores the demonstration. `sample.metadata["demonstration"]` marks them, `agent/demonstrations` is their
share of the step's episodes and `agent/success` leaves them out. Held-out episodes are always the model's.
The sample's reward is the episode's return. No observation is appended
after the last allowed turn, so a sample ends on a model turn (but for the token cap) and the routed
experts of its last request (`return_routed_experts`, MoE routing replay) cover all of its tokens.

`agent_generate` (used when `rollout.agent_fn` is set) hands the task and a session `base_url` of the
session server to the agent function, which may use any OpenAI client; the session server's token
records become the samples (one per trajectory branch), all scored with the agent's reward, each with
`Sample.weight` 1 / (branches of the episode), so that the trainer counts the episode once however many
trajectories it produced (miles/train/losses/aggregate.py).

Both record per-episode facts in `sample.metadata["agent"]` (turns, tool_calls, tool_errors,
tool_timeouts, success, generate_s: time in engine calls, env_s: time in the environment's reset and
steps, reset_s: the reset alone, where a per-episode sandbox starts, and sandbox_start_s and
verifier_s where the environment reports them in its observation's or steps' info); the producer turns
them into `agent/*` metrics. An environment step whose info holds `masked` (a verifier that failed)
marks the sample `metadata["masked"]`: the producer leaves it out of its group.
"""

from __future__ import annotations

import time
from typing import Any

from miles.agentic.sandbox.base import SandboxStartError
from miles.config import ConfigError
from miles.config.plugins import load_function
from miles.rollout.client import EngineError
from miles.rollout.generate import Generator, parse_version
from miles.rollout.tasks import EVAL_OFFSET, Prompt
from miles.sample import Sample, Status

_MARK = "\u2063MILES-TURN\u2063"
"""Stand-in content of the assistant turn when the text after it is rendered (an invisible separator
around a word no template rewrites)."""


class TurnRenderer:
    """Token ids of what follows an assistant turn, from the tokenizer's chat template.

    The history is rendered with a marker as the last assistant turn's content; the text after the
    marker (the end of that turn, the new messages and the next assistant header) is tokenised. When
    the model already ended its turn with the end-of-turn token, that token is not added again.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.eos_id: int = tokenizer.eos_token_id
        self.eos_text: str = tokenizer.eos_token or ""

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool, tools: Any) -> str:
        kwargs = {"tools": tools} if tools else {}
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
        )

    def encode_text(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def opening(self, messages: list[dict[str, Any]], tools: Any = None) -> list[int]:
        return self.encode_text(self._render(messages, True, tools))

    def after_turn(
        self, history: list[dict[str, Any]], new: list[dict[str, Any]], ended: bool, tools: Any = None
    ) -> list[int]:
        """Ids after an assistant turn: its closing, the `new` messages, the next assistant header.
        `ended`: the turn's last token was the end-of-turn token."""
        text = self._render([*history, {"role": "assistant", "content": _MARK}, *new], True, tools)
        if _MARK not in text:
            raise ValueError(
                "the chat template dropped the assistant turn; it cannot render multi-turn episodes"
            )
        suffix = text.split(_MARK, 1)[1]
        if ended and suffix.startswith(self.eos_text):
            suffix = suffix[len(self.eos_text) :]
        return self.encode_text(suffix)


def _renderer(gen: Generator) -> TurnRenderer:
    if "renderer" not in gen.context:
        gen.context["renderer"] = TurnRenderer(gen.encoder.tokenizer)
    return gen.context["renderer"]


def _env_settings(gen: Generator) -> tuple[str, dict[str, Any], int | None, int]:
    cfg = gen.config
    if cfg is None or cfg.env.name is None:
        raise ConfigError("rollout.generate_fn=miles.agentic.rollout:env_generate needs rollout.env.name")
    from miles.agentic.envs.base import env_options

    e = cfg.env
    return e.name, env_options(e.name, e.options, e.sandbox), e.max_turns, e.max_episode_tokens


def _demonstration(gen: Generator, env: Any, prompt: Prompt, s: Sample) -> list[str] | None:
    """The environment's demonstration turns when this sample is one (module docstring), else None."""
    wanted = gen.config.env.demonstrations if gen.config is not None else 0
    episode = prompt.metadata.get("episode")
    held_out = isinstance(episode, dict) and int(episode["index"]) >= EVAL_OFFSET
    if s.index >= wanted or held_out:
        return None
    if gen.routed_experts:
        raise ConfigError("rollout.env.demonstrations with train.routing_replay=rollout: not supported")
    if not hasattr(env, "demonstration"):
        raise ConfigError(
            f"rollout.env.demonstrations: environment {type(env).__name__} has no demonstration()"
        )
    return env.demonstration()


def _episode_task(env: Any, prompt: Prompt) -> dict[str, Any]:
    """The environment's task of this prompt: an `env` task's episode number, or the prompt itself."""
    episode = prompt.metadata.get("episode")
    if isinstance(episode, dict):
        return env.make_task(int(episode["seed"]), int(episode["index"]))
    return {"prompt": prompt.text, "answer": prompt.answer, **prompt.metadata}


class Episode:
    """The growing token sequence of one sample and its per-episode facts."""

    def __init__(self, s: Sample) -> None:
        self.s = s
        self.facts: dict[str, float] = {"turns": 0, "tool_calls": 0, "tool_errors": 0, "env_s": 0.0}
        self.facts.update(generate_s=0.0, success=0.0)

    def add_turn(self, r: Any) -> None:
        s = self.s
        s.response_ids.extend(r.output_ids)
        s.loss_mask.extend([1] * len(r.output_ids))
        s.rollout_logprobs.extend(r.logprobs)
        s.weight_versions.extend(parse_version(v) for v in r.weight_versions)
        self.facts["turns"] += 1

    def add_observation(self, ids: list[int]) -> None:
        s = self.s
        version = s.weight_versions[-1] if s.weight_versions else 0
        s.response_ids.extend(ids)
        s.loss_mask.extend([0] * len(ids))
        s.rollout_logprobs.extend([0.0] * len(ids))
        s.weight_versions.extend([version] * len(ids))

    def add_info(self, info: dict[str, Any]) -> None:
        for key in ("tool_calls", "tool_errors", "tool_timeouts", "success", "sandbox_start_s", "verifier_s",
                    "generated"):  # fmt: skip
            if isinstance(info.get(key), (int, float)):
                self.facts[key] = self.facts.get(key, 0.0) + float(info[key])


async def env_generate(gen: Generator, prompt: Prompt, s: Sample, sampling: dict[str, Any]) -> Sample:
    """One `rollout.env` episode as one sample (module docstring)."""
    from miles.agentic.envs.base import make_env

    name, options, max_turns, max_tokens = _env_settings(gen)
    renderer = _renderer(gen)
    env = make_env(name, **options)
    ep = Episode(s)
    try:
        t0 = time.monotonic()
        try:
            obs = await env.reset(_episode_task(env, prompt))
        except SandboxStartError as e:  # retried by the environment: the episode is dropped, counted
            s.status, s.metadata["error"] = Status.FAILED, str(e)
            s.metadata["agent"] = {**ep.facts, "sandbox_failed": 1.0}
            return s
        ep.facts["reset_s"] = time.monotonic() - t0
        ep.facts["env_s"] += ep.facts["reset_s"]
        ep.add_info(obs.info)
        tools = (
            getattr(env, "tools", None) if gen.config is not None and gen.config.env.render_tools else None
        )
        history = list(obs.messages)
        s.prompt_ids = renderer.opening(history, tools)
        s.prompt = history[-1].get("content", "") if history else ""
        demo = _demonstration(gen, env, prompt, s)
        if gen.config is not None and gen.config.env.demonstrations:
            ep.facts["demonstrations"] = float(demo is not None)  # agent/demonstrations: their share
        if demo is not None:
            s.metadata["demonstration"] = True
        await _play(gen, env, ep, history, sampling, renderer, tools, max_turns, max_tokens, demo)
        if demo is not None:  # agent/success stays the model's own
            ep.facts.pop("success", None)
    finally:
        await env.close()
    s.response = gen.encoder.decode(s.response_ids)
    s.metadata["agent"] = ep.facts
    return s


async def _play(
    gen: Generator,
    env: Any,
    ep: Episode,
    history: list[dict[str, Any]],
    sampling: dict[str, Any],
    renderer: TurnRenderer,
    tools: Any,
    max_turns: int | None,
    max_tokens: int,
    demo: list[str] | None = None,
) -> None:
    """Turns until the environment is done or a limit is hit; sets the sample's status and reward.
    With `demo`, its turns take the engine's place (module docstring)."""
    s = ep.s
    turns = min(t for t in (max_turns, getattr(env, "max_turns", None), 1 << 30) if t is not None)
    slot = hash((s.group_id, s.index))
    for turn in range(turns):
        left = max_tokens - len(s.response_ids)
        if left <= 0:
            s.status = Status.TRUNCATED
            return
        if demo is not None and turn >= len(demo):
            break
        try:
            r = await _model_turn(
                gen, ep, renderer, sampling, left, slot, None if demo is None else demo[turn]
            )
        except EngineError as e:
            if not s.response_ids:
                raise  # the first turn's request is refused: a configuration error, not an episode's
            # a later turn refused (the episode outgrew the engine's context): it ends truncated
            s.status, s.metadata["error"] = Status.TRUNCATED, str(e)
            return
        if r is None:  # the engine never finished the turn: the episode failed
            return
        ep.add_turn(r)
        if r.routed_experts is not None:  # the last turn's request covers the whole sequence (R3)
            s.routed_experts = r.routed_experts
        text = gen.encoder.decode(list(r.output_ids))
        t0 = time.monotonic()
        result = await env.step(text)
        ep.facts["env_s"] += time.monotonic() - t0
        ep.add_info(result.info)
        s.reward += float(result.reward)
        if result.info.get("masked"):  # the episode cannot be scored (a failed verifier): not trained on
            s.metadata["masked"] = str(result.info["masked"])
        if result.done:
            s.status = Status.COMPLETED
            return
        if turn == turns - 1:  # no turn left to answer an observation: the sample ends on a model turn
            break
        ended = bool(r.output_ids) and r.output_ids[-1] == renderer.eos_id
        ids = renderer.after_turn(history, result.messages, ended, tools)
        history.extend([{"role": "assistant", "content": text}, *result.messages])
        ep.add_observation(ids)
    s.status = Status.TRUNCATED


async def _model_turn(
    gen: Generator, ep: Episode, renderer: TurnRenderer, sampling: dict[str, Any], left: int, slot: int,
    demo_turn: str | None,
) -> Any:  # fmt: skip
    """The engine's reply to the episode so far, at most `left` tokens; with `demo_turn`, that turn's
    text forced in the engine's place. Its time goes to the episode's generate_s."""
    s = ep.s
    t0 = time.monotonic()
    try:
        if demo_turn is not None:
            forced = (renderer.encode_text(demo_turn) + [renderer.eos_id])[:left]
            return await gen.call_forced(s, s.prompt_ids + s.response_ids, forced, slot=slot)
        params = {**sampling, "max_new_tokens": min(int(sampling.get("max_new_tokens", left)), left)}
        return await gen.call_engine(s, s.prompt_ids + s.response_ids, params, slot=slot)
    finally:
        ep.facts["generate_s"] += time.monotonic() - t0


AgentFn = Any
"""`rollout.agent_fn`: `async def agent(task: dict, base_url: str) -> float | dict` (a plain function
runs in a worker thread). A dict return holds `reward` and may add episode facts (`turns`,
`tool_calls`, `tool_errors`, `success`, `env_s`, `sandbox_start_s`)."""


def load_agent_fn(spec: str | None) -> AgentFn:
    """The agent function named by `rollout.agent_fn` (`module:function`); errors name the key."""
    return load_function(spec, "rollout.agent_fn")


def _load_agent(gen: Generator) -> AgentFn:
    if "agent_fn" not in gen.context:
        import functools

        fn = load_agent_fn(gen.config.agent_fn if gen.config is not None else None)
        options = dict(gen.config.agent_options) if gen.config is not None else {}
        gen.context["agent_fn"] = functools.partial(fn, **options) if options else fn
    return gen.context["agent_fn"]


async def _session_server(gen: Generator) -> Any:
    """The session server of this generator, started on first use in the rollout event loop."""
    import asyncio

    lock = gen.context.setdefault("server_lock", asyncio.Lock())
    async with lock:
        server = gen.context.get("server")
        if server is None:
            from miles.agentic.session_server import SessionServer

            tok = gen.encoder.tokenizer
            limit = gen.config.max_new_tokens if gen.config is not None else 1024
            server = SessionServer(gen.clients, tok.name_or_path, tokenizer=tok, max_new_tokens=limit)
            await server.start()
            gen.context["server"] = server
        if len(server.clients) == len(gen.clients):
            server.clients = list(gen.clients)  # engines replaced after a loss: talk to the new ones
        return server


def _spans(mask: list[int]) -> int:
    """Runs of 1 in a loss mask: the model turns of a branch."""
    return sum(1 for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1]))


async def agent_generate(
    gen: Generator, prompt: Prompt, s: Sample, sampling: dict[str, Any]
) -> Sample | list[Sample]:
    """One `rollout.agent_fn` episode through a session of the session server (module docstring)."""
    import asyncio
    import inspect

    agent = _load_agent(gen)
    server = await _session_server(gen)
    sid, base_url = server.open_session({"group_id": s.group_id})
    task = _agent_task(gen, prompt)
    t0 = time.monotonic()
    try:
        out = agent(task, base_url) if inspect.iscoroutinefunction(agent) else None
        out = await out if out is not None else await asyncio.to_thread(agent, task, base_url)
    except Exception as e:  # the agent's failure fails this sample, never the run
        server.close_session(sid)
        s.status, s.metadata["error"] = Status.FAILED, f"rollout.agent_fn raised {type(e).__name__}: {e}"
        return s
    elapsed = time.monotonic() - t0
    branches = server.close_session(sid)
    if not branches:
        s.status, s.metadata["error"] = Status.FAILED, "rollout.agent_fn made no chat call"
        return s
    facts = dict(out) if isinstance(out, dict) else {"reward": out}
    reward = float(facts.pop("reward", 0.0) or 0.0)
    for b in branches:  # one episode: its trajectories share its reward and its weight in the group
        b.group_id, b.index, b.reward, b.weight = s.group_id, s.index, reward, 1.0 / len(branches)
        b.prompt, b.answer = s.prompt, s.answer
        b.metadata.update(s.metadata)
        b.response = gen.encoder.decode(b.response_ids)
    main = max(branches, key=lambda b: len(b.response_ids))
    main.metadata["agent"] = {
        "turns": float(_spans(main.loss_mask)),
        # the session parsed each reply: its calls, and the malformed ones the agent got back as text
        "tool_calls": float(main.metadata.get("tool_calls", 0)),
        "tool_errors": float(main.metadata.get("malformed_tool_calls", 0)),
        "success": float(reward >= 1.0),
        "generate_s": elapsed - float(facts.get("env_s", 0.0)),
        **{k: float(v) for k, v in facts.items() if isinstance(v, (int, float))},
    }
    return [main, *(b for b in branches if b is not main)]


def _agent_task(gen: Generator, prompt: Prompt) -> dict[str, Any]:
    """An environment task when `rollout.env` names one, else the prompt's text, answer and metadata."""
    cfg = gen.config
    episode = prompt.metadata.get("episode")
    if cfg is not None and cfg.env.name is not None and isinstance(episode, dict):
        from miles.agentic.envs.base import env_options, make_env

        options = env_options(cfg.env.name, cfg.env.options, cfg.env.sandbox)
        return make_env(cfg.env.name, **options).make_task(int(episode["seed"]), int(episode["index"]))
    meta = {k: v for k, v in prompt.metadata.items() if k != "sampling"}
    return {"prompt": prompt.text, "answer": prompt.answer, **meta}
