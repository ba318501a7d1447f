"""Black-box agents: an external program as the agent of an episode.

    rollout:
      agent_fn: miles.agentic.program:program_agent
      agent_options:
        command: python3 examples/agents/delegating_agent.py
        timeout_s: 60
        reward_fn: miles.rollout.rewards:first_number

For each episode the program runs beside the rollout (a subprocess of it, in its own process group,
killed at `timeout_s`), knowing nothing of Miles but its environment:

    OPENAI_BASE_URL   the episode's session of the session server (any OpenAI client uses it)
    OPENAI_API_KEY    a placeholder (the session server does not check it)
    MILES_TASK        the task as JSON (prompt text, answer, metadata), for programs that want it

and the prompt on standard input. It may open sub-agents, each a session of its own, with
`POST {OPENAI_BASE_URL}/subagents`; every session it opened is part of the episode: all their
trajectories (and forks of edited histories) come back in the prompt's group, each with weight
1 / (trajectories of the episode), so the task's gradient does not grow with how many there were. The
program's last line of standard output is its answer; `reward_fn` scores it like a plain sample
(`sample.response` = the answer, `sample.answer` = the task's). A program that fails or times out
fails the episode (retried with the group), never the run.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
from typing import Any

from miles.config.plugins import load_function
from miles.sample import Sample


async def program_agent(
    task: dict[str, Any],
    base_url: str,
    command: str = "",
    timeout_s: float = 60.0,
    reward_fn: str = "miles.rollout.rewards:first_number",
) -> dict[str, float]:
    """Run `command` as the episode's agent (module docstring); returns its reward and facts."""
    if not command:
        raise ValueError("rollout.agent_options.command is empty: name the program to run as the agent")
    env = {
        **os.environ,
        "OPENAI_BASE_URL": base_url,
        "OPENAI_API_KEY": "miles-session",
        "MILES_TASK": json.dumps(task, default=str),
    }
    proc = await asyncio.create_subprocess_exec(
        *shlex.split(command),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
        start_new_session=True,
    )
    prompt = str(task.get("prompt", ""))
    try:
        out, err = await asyncio.wait_for(proc.communicate(prompt.encode()), timeout_s)
    except (asyncio.TimeoutError, asyncio.CancelledError):
        _kill(proc)
        await proc.wait()
        raise RuntimeError(f"agent program {command!r} ran past {timeout_s:g} s") from None
    if proc.returncode != 0:
        raise RuntimeError(
            f"agent program {command!r} exited with {proc.returncode}: {err.decode(errors='replace')[-500:]}"
        )
    lines = out.decode(errors="replace").strip().splitlines()
    answer = lines[-1] if lines else ""
    score = load_function(reward_fn, "rollout.agent_options.reward_fn")
    probe = Sample(0, 0, [0], response=answer, answer=task.get("answer"), metadata=dict(task))
    return {"reward": float(await asyncio.to_thread(score, probe))}


def _kill(proc: asyncio.subprocess.Process) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
