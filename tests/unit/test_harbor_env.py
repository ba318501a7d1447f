"""The `harbor` environment in real bubblewrap sandboxes, played with scripted assistant turns: tool
calls in the compact and JSON forms act in /app, the verifier's reward ends the episode, an episode
without a tool call is graded by the tests, a failed verifier masks the episode, and the options are
checked; sandboxes started ahead by the pool, and the container backend's command line."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from pathlib import Path

import pytest

from miles.agentic.envs.base import make_env
from miles.agentic.harbor import sandboxes
from miles.agentic.harbor.episode import Episode
from miles.agentic.harbor.generate import make_task
from miles.agentic.harbor.sandboxes import episode_settings, make_sandbox, task_image
from miles.agentic.harbor.task import load_task
from miles.agentic.sandbox.base import SandboxStartError
from miles.agentic.sandbox.container import REAPER, ContainerSandboxConfig
from miles.rollout.tasks import EVAL_OFFSET

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
SHIPPED = Path(__file__).resolve().parents[2] / "tasks"


def _solve_generated(instruction: str) -> str:
    """The right first turn for a generated task: a compact call, or the JSON form for the edit."""
    m = re.match(r"Create the file (\S+) in /app containing (\S+)\.", instruction)
    if m:
        return f"<tool_call>bash echo {m.group(2)} > {m.group(1)}</tool_call>"
    m = re.match(r"Set mode=(\S+) in /app/settings.txt\.", instruction)
    assert m, instruction
    call = {"name": "bash", "arguments": {"command": f"sed -i s/^mode=.*/mode={m.group(1)}/ settings.txt"}}
    return f"<tool_call>{json.dumps(call)}</tool_call>"


def test_generated_tasks_scored_by_their_tests() -> None:
    env = make_env("harbor", generate=True, max_turns=4)

    async def episode(index: int, solve: bool):
        obs = await env.reset(env.make_task(3, index))
        assert obs.messages[0]["role"] == "system" and "sandbox_start_s" in obs.info
        steps = []
        if solve:
            steps.append(await env.step(_solve_generated(obs.messages[-1]["content"])))
        steps.append(await env.step("<tool_call>submit done</tool_call>"))
        await env.close()
        return steps

    for index in (0, 1, 2, EVAL_OFFSET):
        solved = asyncio.run(episode(index, True))
        assert not solved[0].done and solved[0].messages[0]["content"].endswith("[exit code 0]")
        assert solved[-1].done and solved[-1].reward == 1.0 and solved[-1].info["success"]
        assert solved[-1].info["verifier_s"] > 0 and "masked" not in solved[-1].info
        idle = asyncio.run(episode(index, False))
        assert idle[-1].done and idle[-1].reward == 0.0
    assert env.make_task(3, 5) == env.make_task(3, 5) and env.make_task(3, 5) != env.make_task(
        3, EVAL_OFFSET + 5
    )


def test_a_dataset_episode_with_file_tools_and_a_final_answer() -> None:
    env = make_env("harbor", tasks=str(SHIPPED), eval_tasks=str(SHIPPED / "repair-config"), max_turns=5)
    names = [Path(env.make_task(0, i)["path"]).name for i in range(4)]
    assert sorted(names) == ["fix-median", "git-commit", "greet-script", "repair-config"]
    assert Path(env.make_task(0, EVAL_OFFSET + 2)["path"]).name == "repair-config"
    config = {"name": "inventory", "port": 8080, "debug": False, "workers": 4, "paths": ["/data", "/cache"]}
    write = {"name": "write_file", "arguments": {"path": "config.json", "content": json.dumps(config)}}

    async def go():
        await env.reset(env.make_task(0, EVAL_OFFSET))
        read = await env.step("<tool_call>read_file config.json</tool_call>")
        missing = await env.step("<tool_call>read_file nope.json</tool_call>")
        wrote = await env.step(f"<tool_call>{json.dumps(write)}</tool_call>")
        final = await env.step("The configuration is repaired.")  # no tool call: the episode ends
        await env.close()
        return read, missing, wrote, final

    read, missing, wrote, final = asyncio.run(go())
    assert "'debug': false" in read.messages[0]["content"]
    assert missing.info["tool_errors"] == 1 and "error" in missing.messages[0]["content"]
    assert wrote.messages[0]["content"].startswith("wrote ")
    assert final.done and final.reward == 1.0


def test_a_verifier_that_times_out_masks_the_episode(tmp_path) -> None:
    task = tmp_path / "slow"
    for rel, text in {
        "task.toml": "[verifier]\ntimeout_sec = 0.5\n",
        "instruction.md": "Wait.\n",
        "environment/Dockerfile": "FROM x\nWORKDIR /app\n",
        "tests/test.sh": "sleep 30\n",
    }.items():
        (task / rel).parent.mkdir(parents=True, exist_ok=True)
        (task / rel).write_text(text)
    env = make_env("harbor", tasks=[str(task)], max_turns=2)

    async def go():
        await env.reset(env.make_task(0, 0))
        result = await env.step("<tool_call>submit</tool_call>")
        await env.close()
        return result

    result = asyncio.run(go())
    assert result.done and result.reward == 0.0 and result.info["masked"] == "verifier timeout"


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match="give options.tasks"):
        make_env("harbor")
    with pytest.raises(ValueError, match=r"generate_share=1.5 must lie in \(0, 1\)"):
        make_env("harbor", tasks=str(SHIPPED), generate=True, generate_share=1.5)
    with pytest.raises(ValueError, match="internet='on'"):
        make_env("harbor", generate=True, internet="on")
    with pytest.raises(ValueError, match="start_ahead"):
        make_env("harbor", generate=True, start_ahead=5, max_live=2)
    with pytest.raises(ValueError, match="runtime"):
        make_env("harbor", generate=True, backend={"runtime": "docker"})


def test_a_dataset_mixed_with_generated_tasks_in_the_share_asked() -> None:
    """tasks + generate: generate_share of the training indices, spread evenly, play generated tasks,
    the rest the dataset's in turn; held-out episodes play the dataset's alone."""
    env = make_env("harbor", tasks=str(SHIPPED), generate=True, generate_share=0.25)
    picks = [env.make_task(0, i) for i in range(40)]
    assert sum(p["generated"] for p in picks) == 10
    assert [p["generated"] for p in picks[:8]] == [False, False, False, True] * 2
    shipped = {str(p.resolve()) for p in SHIPPED.iterdir() if p.is_dir()}
    assert {str(Path(p["path"]).resolve()) for p in picks if not p["generated"]} == shipped
    assert all(str(Path(p["path"]).resolve()) not in shipped for p in picks if p["generated"])
    held_out = [env.make_task(0, EVAL_OFFSET + i) for i in range(8)]
    assert not any(p["generated"] for p in held_out)


def test_episodes_take_sandboxes_started_ahead_and_leave_nothing() -> None:
    """With start_ahead 2 an episode after the first finds its sandbox already created by the pool;
    every sandbox (used or only started) is gone once the episodes and the pool are closed."""
    env = make_env("harbor", generate=True, max_turns=2, start_ahead=2)

    async def go():
        paths, from_ready = [], []
        for index in range(4):
            pools = sandboxes._pools.get(asyncio.get_running_loop(), {})
            await asyncio.sleep(0.2)  # the background starts of the previous hand-out
            ready = [sb for pool in pools.values() for sb in pool._ready]
            obs = await env.reset(env.make_task(1, index))
            assert obs.info["sandbox_start_s"] >= 0
            from_ready.append(env.episode.sandbox in ready)
            paths.append(env.episode.sandbox.path)
            result = await env.step("<tool_call>submit</tool_call>")
            assert result.done and result.reward == 0.0
            await env.close()
            assert not paths[-1].exists(), "an episode's sandbox outlived it"
        (pool,) = sandboxes._pools[asyncio.get_running_loop()].values()
        started = [sb.path for sb in pool._ready]
        assert len(started) == 2 and all(p.exists() for p in started)
        await pool.close()
        return from_ready, started

    from_ready, started = asyncio.run(go())
    assert from_ready == [False, True, True, True]
    assert not any(p.exists() for p in started), "a sandbox started ahead outlived the pool"


def test_container_backend_runs_the_task_image_with_harbor_directories(tmp_path) -> None:
    """The apptainer backend's command line for a generated task: the Dockerfile's FROM image, the
    episode's /app, /tests, /logs, /solution bound in, /app as working directory, no network; on a
    host without apptainer the episode fails to start with a message naming it."""

    task = load_task(make_task(tmp_path, 0, 0))
    backend = ContainerSandboxConfig(runtime="apptainer")
    assert task_image(task) == "docker://debian:bookworm-slim"
    sb = make_sandbox(task, episode_settings(task), backend)
    argv = sb._command("/node/sb-1", ["bash", "-c", "ls"])
    assert argv[1:3] == ["-I", REAPER]  # the runtime's forks die with the episode's owner
    runtime = argv.index("apptainer")
    assert argv[runtime + 1 : runtime + 3] == ["--silent", "exec"] and "docker://debian:bookworm-slim" in argv
    binds = [argv[i + 1] for i, a in enumerate(argv) if a in ("--bind", "--home")]
    assert binds == ["/node/sb-1:/sandbox", "/node/sb-1/app:/app", "/node/sb-1/tests:/tests",
                     "/node/sb-1/logs:/logs", "/node/sb-1/solution:/solution"]  # fmt: skip
    assert argv[argv.index("--pwd") + 1] == "/app" and argv[argv.index("--network") + 1] == "none"
    assert argv[-3:] == ["bash", "-c", "ls"]
    enroot = make_sandbox(task, episode_settings(task), backend.model_copy(update={"runtime": "enroot"}))
    argv = enroot._command("/node/sb-2", ["ls"])
    assert "--mount" in argv and "/node/sb-2/app:/app" in argv and "/app" in argv[argv.index("sh") :]
    if shutil.which("apptainer") is None:
        with pytest.raises(SandboxStartError, match="apptainer not found"):
            asyncio.run(Episode(task, backend=backend).start())


def test_the_sandbox_backend_comes_from_the_profile_and_reaches_the_harbor_environment() -> None:
    """`miles submit` with a profile whose container.sandbox says enroot gives the run
    rollout.env.sandbox = enroot; the harbor environment gets it as its backend, an environment
    without sandboxes does not; a recipe may set its own; a dict in rollout.env.options is refused
    with a message naming where a backend goes."""
    from miles.agentic.envs.base import env_options
    from miles.config import resolve
    from miles.config.base import ConfigError
    from miles.config.profile import load_profile, profile_defaults

    harbor = {"generate_fn": "miles.agentic.rollout:env_generate", "task": {"name": "env"},
              "env": {"name": "harbor", "options": {"generate": True}}}  # fmt: skip
    on_h200 = resolve({"rollout": harbor}, profile_defaults=profile_defaults(load_profile("h200")))
    assert on_h200.rollout.env.sandbox.runtime == "enroot"
    assert resolve({"rollout": harbor}).rollout.env.sandbox is None  # this host: bubblewrap
    own = {**harbor, "env": {**harbor["env"], "sandbox": {"runtime": "apptainer", "network": "host"}}}
    mine = resolve({"rollout": own}, profile_defaults=profile_defaults(load_profile("h200")))
    assert (mine.rollout.env.sandbox.runtime, mine.rollout.env.sandbox.network) == ("apptainer", "host")
    local = {**harbor, "env": {**harbor["env"], "sandbox": None}}
    assert (
        resolve(
            {"rollout": local}, profile_defaults=profile_defaults(load_profile("h200"))
        ).rollout.env.sandbox
        is None
    )

    env = on_h200.rollout.env
    env_ = make_env(env.name, **env_options(env.name, env.options, env.sandbox))
    assert env_.backend is not None and env_.backend.runtime == "enroot"
    assert "backend" not in env_options("calculator", {}, env.sandbox)
    make_env("calculator", **env_options("calculator", {}, env.sandbox))
    bad = {**harbor, "env": {**harbor["env"], "options": {"backend": {"runtime": "enroot"}}}}
    with pytest.raises(ConfigError, match="a sandbox backend goes in rollout.env.sandbox"):
        resolve({"rollout": bad})
