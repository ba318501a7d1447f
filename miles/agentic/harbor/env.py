"""`harbor`: coding and terminal episodes on Harbor-format tasks, one fresh sandbox per episode.

    rollout:
      generate_fn: miles.agentic.rollout:env_generate
      task: {name: env}
      env:
        name: harbor
        options: {tasks: [tasks/], eval_tasks: [my-heldout/], max_turns: 8}   # a dataset ...
        # options: {generate: true, generate_seed: 0}                         # ... or generated tasks

The opening messages are a system prompt naming the tools and the task's instruction.md; the tools act
in the episode's sandbox (miles/agentic/harbor/episode.py): `bash` (a command in /app; its output cut
to `output_limit` characters, the cut said; the exit code or why it was stopped), `read_file`,
`write_file`, `str_replace` (the old text must occur exactly once) and `submit`. Tool calls come as
OpenAI tool calls, the standard `<tool_call>{json}</tool_call>` form, or the compact
`<tool_call>bash ls -l</tool_call>` form (a tool's main argument after its name), which a tiny model
can learn. The episode ends on `submit`, on a turn without a tool call, or at max_turns; then the
task's verifier runs and its reward is the episode's. A verifier that times out or fails without a
reward marks the sample masked (`info["masked"]`): the producer leaves it out of its group and counts
it (`rollout/masked_samples`), it is not trained on as reward 0.

Sandboxes: `backend` (in a run: `rollout.env.sandbox`, by default the profile's `container.sandbox`)
None runs episodes in bubblewrap on this host; {runtime: apptainer} or enroot (the fields of
miles/config/profile.py's ContainerSandboxConfig) runs them in each task's own image. Episodes take
their sandboxes from per-process pools that keep `start_ahead` of them started
(miles/agentic/harbor/sandboxes.py); `agent/sandbox_start_s` is what an episode waited for its
sandbox and the Dockerfile's replay. `internet` (auto | off): whether tasks that set allow_internet
get egress where the node has it (miles/agentic/harbor/sandboxes.py).

Task choice: with `tasks` (task directories or dataset folders) training episode `index` plays task
`index mod n` and held-out episodes (indices from EVAL_OFFSET) play `eval_tasks` (default: the same
tasks); with `generate` every index is its own task from miles/agentic/harbor/generate.py, written
once into a cache directory outside the run directory. With both, `generate_share` (default 0.5) of
the training episodes, spread evenly, play generated tasks and the others the dataset's, and
held-out episodes play the dataset's; `agent/generated` is the share a step's episodes had.
"""

from __future__ import annotations

import contextlib
import functools
import tempfile
import time
from pathlib import Path
from typing import Any

from miles.agentic.envs.base import Action, Message, StepResult
from miles.agentic.envs.toolenv import ToolEnv
from miles.agentic.envs.tools import Tool, ToolError, ToolOutcome
from miles.agentic.harbor.episode import OUTPUT_LIMIT, Episode, StepUnhealthy
from miles.agentic.harbor.sandboxes import episode_settings, pool_for, prepare_image
from miles.agentic.harbor.sandboxes import internet as choose_internet
from miles.agentic.harbor.task import Task, load_dataset, load_task
from miles.agentic.sandbox.container import ContainerSandboxConfig
from miles.rollout.tasks import EVAL_OFFSET

SYSTEM = (
    "You are working in a Linux sandbox whose working directory is /app. Use the tools to inspect and "
    "change files and run commands: bash, read_file, write_file, str_replace. Call submit when the task "
    "is done."
)


@functools.lru_cache(maxsize=4096)
def _cached(path: str) -> Task:
    """A task read once per process (bounded: generated tasks are new at every index)."""
    return load_task(path)


class HarborEnv(ToolEnv):
    """Harbor tasks with sandboxed coding tools; see the module docstring."""

    name = "harbor"
    sandbox_option = "backend"
    """The constructor option `rollout.env.sandbox` is given as (miles/agentic/envs/base.py)."""

    def __init__(
        self,
        tasks: list[str] | str | None = None,
        eval_tasks: list[str] | str | None = None,
        generate: bool = False,
        generate_seed: int = 0,
        generate_share: float = 0.5,
        max_turns: int = 8,
        bash_timeout_s: float = 10.0,
        output_limit: int = OUTPUT_LIMIT,
        system_prompt: str = SYSTEM,
        backend: dict[str, Any] | ContainerSandboxConfig | None = None,
        start_ahead: int = 2,
        max_live: int = 256,
        internet: str | None = None,
    ) -> None:
        super().__init__(max_turns)
        if internet is not None:  # None: each episode reads the node's default (MILES_TASKS_INTERNET)
            choose_internet(internet)
        self.internet = internet
        if not 0 <= start_ahead <= max_live:
            raise ValueError(f"harbor: options.start_ahead={start_ahead} must be in 0..max_live={max_live}")
        self.backend = ContainerSandboxConfig.model_validate(backend) if backend is not None else None
        self.start_ahead, self.max_live = int(start_ahead), int(max_live)
        self._held = contextlib.AsyncExitStack()
        if tasks is None and not generate:
            raise ValueError("harbor: give options.tasks (task folders), options.generate: true, or both")
        if not 0.0 < generate_share < 1.0:
            raise ValueError(f"harbor: options.generate_share={generate_share} must lie in (0, 1)")
        self.generate, self.generate_share = bool(generate), float(generate_share)
        as_list = (lambda x: [x] if isinstance(x, str) else list(x)) if tasks is not None else None
        self.train_paths = [str(t.path) for t in load_dataset(as_list(tasks))] if as_list else []
        self.eval_paths = (
            [str(t.path) for t in load_dataset(as_list(eval_tasks))] if as_list and eval_tasks else []
        )
        self.generate_seed = int(generate_seed)
        self.bash_timeout_s = bash_timeout_s
        self.output_limit = output_limit
        self.system_prompt = system_prompt
        self.episode: Episode | None = None
        self.outcome: dict[str, Any] = {}
        self._submitted = False
        self._tools = self._coding_tools(bash_timeout_s)

    def _coding_tools(self, bash_timeout_s: float) -> dict[str, Tool]:
        """The episode's tools: bash, reading, writing and editing files, submitting."""
        return {
            "bash": Tool("bash", "Run a shell command in /app and return its output.",
                         {"command": {"type": "string", "description": "the command"}}, self._bash,
                         timeout_s=bash_timeout_s + 5.0),
            "read_file": Tool("read_file", "Return the content of a file.",
                              {"path": {"type": "string", "description": "file path (relative to /app)"}},
                              self._read, timeout_s=10.0),
            "write_file": Tool("write_file", "Write a file (creating directories), replacing its content.",
                               {"path": {"type": "string", "description": "file path"},
                                "content": {"type": "string", "description": "the new content"}},
                               self._write, timeout_s=10.0),
            "str_replace": Tool("str_replace", "Replace text that occurs exactly once in a file.",
                                {"path": {"type": "string", "description": "file path"},
                                 "old": {"type": "string", "description": "the text to replace"},
                                 "new": {"type": "string", "description": "its replacement"}},
                                self._replace, timeout_s=10.0),
            "submit": Tool("submit", "Say that the task is done; the tests run next.",
                           {"note": {"type": "string", "description": "optional remark"}}, self._submit,
                           timeout_s=1.0),
        }  # fmt: skip

    # ---- tasks -------------------------------------------------------------------------------------

    def generated(self, index: int) -> bool:
        """Whether training episode `index` plays a generated task: all of them without options.tasks;
        with both, `generate_share` of them, spread evenly (index i when floor((i+1)s) > floor(i s))."""
        if not self.train_paths:
            return True
        share = self.generate_share
        return self.generate and int((index + 1) * share) > int(index * share)

    def make_task(self, seed: int, index: int) -> dict[str, Any]:
        held_out = index >= EVAL_OFFSET
        if not self.train_paths or (not held_out and self.generated(index)):
            from miles.agentic.harbor.generate import make_task

            out = Path(tempfile.gettempdir()) / f"miles-harbor-tasks-{self.generate_seed}-{seed}"
            path = make_task(out, self.generate_seed * 7919 + seed, index)
            return {"path": str(path), "id": index, "generated": True}
        paths = self.eval_paths if held_out and self.eval_paths else self.train_paths
        k = (index - EVAL_OFFSET) if held_out else index
        if self.generate and not held_out:  # the dataset's tasks in turn over the indices they get
            k = index - int(index * self.generate_share)
        return {"path": paths[k % len(paths)], "id": index, "generated": False}

    def opening(self, task: dict[str, Any]) -> list[Message]:
        t = _cached(task["path"])
        first = t.task_steps[0].instruction if t.task_steps else t.instruction  # a multi-step task's first
        return [
            {"role": "system", "content": self.system_prompt},
            {"role": "user", "content": first.strip()},
        ]

    def demonstration(self) -> list[str] | None:
        """The current task's oracle as assistant turns (`rollout.env.demonstrations`): the body of
        solution/solve.sh as one compact bash call (it runs in /app, as the verifier's oracle does),
        then submit; None when the task has no solution."""
        task = _cached(self.task["path"])
        dirs = [s.part("solution") for s in task.task_steps] if task.task_steps else [task.solution_dir]
        if any(d is None for d in dirs):
            return None
        turns = []
        for d in dirs:  # a multi-step task: each step's solution, then submit, step by step
            lines = (d / "solve.sh").read_text().splitlines()
            body = "\n".join(x for x in lines if x.strip() and not x.startswith("#!")).strip()
            turns += [f"<tool_call>bash {body}</tool_call>", "<tool_call>submit</tool_call>"]
        return turns

    # ---- episode -----------------------------------------------------------------------------------

    async def setup(self) -> None:
        self._submitted, self.outcome = False, {}
        t0 = time.monotonic()
        task = _cached(self.task["path"])
        await prepare_image(task, self.backend)
        settings = episode_settings(task, None, self.internet)
        pool = pool_for(task, settings, self.backend, self.start_ahead, self.max_live, self.internet)
        sandbox = await self._held.enter_async_context(pool.acquire())  # closed and wiped by close()
        self.episode = Episode(task, output_limit=self.output_limit, sandbox=sandbox, internet=self.internet)
        await self.episode.start()
        self._step, self._step_rewards, self._masked = 0, [], ""
        if task.task_steps:
            await self.episode.begin_step(task.task_steps[0])
        self.outcome["sandbox_start_s"] = time.monotonic() - t0

    async def close(self) -> None:
        self.episode = None
        await self._held.aclose()

    async def reset(self, task: dict[str, Any]):  # type: ignore[override]
        obs = await super().reset(task)
        obs.info["sandbox_start_s"] = self.outcome["sandbox_start_s"]
        obs.info["generated"] = float(bool(task.get("generated")))  # agent/generated: their share
        return obs

    def grade(self, answer: str) -> float:
        return 0.0  # a turn without a tool call ends the episode; the verifier decides (step)

    def after_tools(self, outcome: ToolOutcome) -> float | None:
        return 0.0 if self._submitted else None

    async def step(self, action: Action) -> StepResult:
        result = await super().step(action)
        if not result.done:
            return result
        assert self.episode is not None
        task = _cached(self.task["path"])
        step = task.task_steps[self._step] if task.task_steps else None
        verdict = await self.episode.verify(step)
        info = dict(result.info)
        info["verifier_s"] = verdict.seconds
        reward = verdict.reward if verdict.reward is not None else 0.0
        if verdict.reward is None:
            self._masked = f"verifier {verdict.status}" + (f" (step {step.name})" if step else "")
        if step is not None:
            if (following := await self._next_step(task, step, reward, result)) is not None:
                return following
            info["step_rewards"] = list(self._step_rewards)
            reward = task.reward(self._step_rewards)
        if self._masked:
            info["masked"] = self._masked
        info["success"] = reward >= 1.0
        info["episode"] = {
            **info.get("episode", {}),
            "success": float(reward >= 1.0),
            "verifier_s": verdict.seconds,
            **{f"reward_{k}": v for k, v in (verdict.rewards or {}).items()},  # reward.json's dimensions
        }
        return StepResult(result.messages, reward, True, info)

    async def _next_step(self, task, step, reward: float, result: StepResult) -> StepResult | None:
        """A multi-step task after `step` was verified: the next step's instruction as a user turn
        (the episode goes on), or None when it ends (the last step, a reward below the step's
        min_reward, or the turn budget spent)."""
        self._step_rewards.append(reward)
        last = self._step + 1 >= len(task.task_steps)
        below = step.config.min_reward is not None and reward < step.config.min_reward
        if last or below or self.turns >= self.max_turns:
            return None
        self._step += 1
        nxt = task.task_steps[self._step]
        try:
            await self._live().begin_step(nxt)
        except StepUnhealthy:
            self._step_rewards.append(0.0)  # the step cannot start: it scores 0 and the episode ends
            return None
        self.done, self._submitted = False, False
        info = {**result.info, "step": step.name, "step_reward": reward}
        return StepResult(
            [*result.messages, {"role": "user", "content": nxt.instruction.strip()}], 0.0, False, info
        )

    # ---- tools -------------------------------------------------------------------------------------

    def _live(self) -> Episode:
        if self.episode is None:
            raise ToolError("no episode is running")
        return self.episode

    async def _bash(self, command: str) -> str:
        return await self._live().bash(command, self.bash_timeout_s)

    async def _read(self, path: str) -> str:
        try:
            return await self._live().read_file(path)
        except Exception as e:  # a missing file or a path outside the sandbox: the model's error
            raise ToolError(str(e)) from None

    async def _write(self, path: str, content: str) -> str:
        try:
            return await self._live().write_file(path, content)
        except Exception as e:
            raise ToolError(str(e)) from None

    async def _replace(self, path: str, old: str, new: str) -> str:
        try:
            return await self._live().str_replace(path, old, new)
        except Exception as e:
            raise ToolError(str(e)) from None

    async def _submit(self, note: str = "") -> str:
        self._submitted = True
        return "submitted; the tests run now"
