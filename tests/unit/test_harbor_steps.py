"""Harbor's multi-step tasks (schema 1.1, [[steps]] with steps/<name>/ holding each step's
instruction, tests laid over the task's, solution and workdir): read, checked by `miles tasks check`
(every step's solution scores 1, doing nothing 0, early stop on min_reward), and played by the
`harbor` environment turn by turn, the next step's instruction arriving after each verified step, the
episode's reward the task's roll-up of its step rewards."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from miles.agentic.envs.base import make_env
from miles.agentic.harbor.task import TaskError, load_task

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")

TOML = """schema_version = "1.1"
multi_step_reward_strategy = "{strategy}"
[environment]
workdir = "/app"
[[steps]]
name = "scaffold"
min_reward = 1.0
[steps.verifier]
timeout_sec = 20.0
[[steps]]
name = "implement"
[steps.verifier]
timeout_sec = 20.0
[steps.verifier.env]
EXPECTED = "Hello, Harbor!"
"""
CHECK = "source /tests/helpers.sh\n{body}\n"
FILES = {
    "environment/Dockerfile": "FROM debian:bookworm-slim\nWORKDIR /app\n",
    "tests/helpers.sh": 'score() { mkdir -p /logs/verifier; if eval "$1"; then echo 1; else echo 0; fi > /logs/verifier/reward.txt; }\n',
    "steps/scaffold/instruction.md": "Create an executable /app/greet.sh that prints hello.\n",
    "steps/scaffold/tests/test.sh": CHECK.format(
        body="score '[ -x /app/greet.sh ] && [ \"$(/app/greet.sh)\" = hello ]'"
    ),
    "steps/scaffold/solution/solve.sh": "printf '#!/bin/bash\\necho hello\\n' > /app/greet.sh; chmod +x /app/greet.sh\n",
    "steps/implement/instruction.md": "Make greet.sh greet the name in /app/config.txt as 'Hello, NAME!'.\n",
    "steps/implement/workdir/config.txt": "Harbor\n",
    "steps/implement/workdir/setup.sh": "echo prepared > /app/prepared.txt\n",
    "steps/implement/tests/test.sh": CHECK.format(
        body='score \'[ -f /app/prepared.txt ] && [ "$(/app/greet.sh)" = "$EXPECTED" ]\''
    ),
    "steps/implement/solution/solve.sh": "printf '#!/bin/bash\\necho \"Hello, $(cat /app/config.txt)!\"\\n' > /app/greet.sh\n",
}


def multi_step_task(root: Path, strategy: str = "mean") -> Path:
    for rel, text in {"task.toml": TOML.format(strategy=strategy), **FILES}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_steps_are_read_and_their_rewards_rolled_up(tmp_path) -> None:
    task = load_task(multi_step_task(tmp_path / "t"))
    assert [s.name for s in task.task_steps] == ["scaffold", "implement"] and task.instruction == ""
    assert task.task_steps[1].config.verifier.env == {"EXPECTED": "Hello, Harbor!"}
    assert task.reward([1.0]) == 0.5 and task.reward([1.0, 1.0]) == 1.0  # mean: a step not run counts 0
    final = load_task(multi_step_task(tmp_path / "f", "final"))
    assert final.reward([1.0, 0.0]) == 0.0 and final.reward([1.0]) == 1.0
    (tmp_path / "t" / "steps" / "implement" / "instruction.md").unlink()
    with pytest.raises(TaskError, match=r"steps/implement/instruction.md: missing or empty"):
        load_task(tmp_path / "t")


def test_the_check_runs_each_step_and_its_solution(tmp_path) -> None:
    multi_step_task(tmp_path / "set" / "greeter")
    out = subprocess.run(
        [sys.executable, "-m", "miles", "tasks", "check", str(tmp_path / "set")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0 and "1/1 tasks passed" in out.stdout, out.stdout + out.stderr
    broken = multi_step_task(tmp_path / "bad" / "greeter")
    (broken / "steps" / "implement" / "solution" / "solve.sh").write_text("true\n")
    out = subprocess.run(
        [sys.executable, "-m", "miles", "tasks", "check", str(tmp_path / "bad")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 1 and "the oracle (solution/solve.sh) scored 0.5" in out.stdout, out.stdout
    assert "step implement: 0" in out.stdout


def _play(task: Path, turns: list[str]):
    env = make_env("harbor", tasks=[str(task)], max_turns=8)

    async def go():
        obs = await env.reset(env.make_task(0, 0))
        results = []
        for turn in turns:
            results.append(await env.step(turn))
            if results[-1].done:
                break
        await env.close()
        return obs, results

    return asyncio.run(go())


def test_an_episode_plays_the_steps_in_turn(tmp_path) -> None:
    task = multi_step_task(tmp_path / "t")
    env = make_env("harbor", tasks=[str(task)], max_turns=8)
    env.task = {"path": str(task)}
    solved = env.demonstration()
    obs, results = _play(task, solved)
    assert obs.messages[-1]["content"].startswith("Create an executable /app/greet.sh")
    nxt = results[1]  # the first step's submit: verified, the second step's instruction follows
    assert not nxt.done and nxt.info["step_reward"] == 1.0
    assert nxt.messages[-1] == {"role": "user", "content": FILES["steps/implement/instruction.md"].strip()}
    assert results[-1].done and results[-1].reward == 1.0 and results[-1].info["step_rewards"] == [1.0, 1.0]
    # a first step below its min_reward ends the episode there: the mean counts the second as 0
    _, stopped = _play(task, ["<tool_call>bash echo nothing</tool_call>", "<tool_call>submit</tool_call>"])
    assert stopped[-1].done and stopped[-1].reward == 0.0 and stopped[-1].info["step_rewards"] == [0.0]


def test_a_step_whose_healthcheck_never_passes_scores_0_and_ends_the_episode(tmp_path) -> None:
    """[steps.healthcheck] is polled after the step's workdir and setup.sh: the oracle's greet.sh
    passes it; a check that cannot pass scores the step 0, named in the check's row, and the later
    steps do not run (under the mean, they count 0)."""
    from miles.agentic.harbor.check import check_task, report

    root = multi_step_task(tmp_path / "hc")
    toml = (root / "task.toml").read_text()
    healthy = (
        toml + '[steps.healthcheck]\ncommand = "test -x /app/greet.sh"\ninterval_sec = 0.1\nretries = 2\n'
    )
    (root / "task.toml").write_text(healthy)
    ok = asyncio.run(check_task(load_task(root)))
    assert ok.passed and ok.oracle.reward == 1.0, report([ok])[0]
    (root / "task.toml").write_text(healthy.replace("test -x /app/greet.sh", "test -f /app/never"))
    sick = asyncio.run(check_task(load_task(root)))
    table, passed = report([sick])
    assert not passed and sick.oracle.reward == 0.5  # scaffold 1, implement 0: its check failed
    assert "step implement: healthcheck `test -f /app/never` failed 2 times" in table


def test_named_rewards_in_reward_json_give_their_mean_and_are_kept(tmp_path) -> None:
    """Harbor's reward.json may hold several named rewards (no "reward" key): the episode's reward is
    their mean and each is kept; a "reward" key wins; a reward that is not a number masks the sample."""
    from miles.agentic.harbor.episode import Episode

    root = tmp_path / "dims"
    files = {
        "task.toml": 'version = "1.0"\n[verifier]\ntimeout_sec = 20\n',
        "instruction.md": "Do it.\n",
        "environment/Dockerfile": "FROM debian:bookworm-slim\nWORKDIR /app\n",
        "tests/test.sh": "mkdir -p /logs/verifier; cat /app/reward.json > /logs/verifier/reward.json\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    task = load_task(root)

    async def verdict(payload: str):
        async with Episode(task) as ep:
            await ep.write_file("reward.json", payload)
            return await ep.verify()

    two = asyncio.run(verdict('{"correctness": 1, "speed": 0}'))
    assert (two.reward, two.status, two.rewards) == (0.5, "ok", {"correctness": 1.0, "speed": 0.0})
    keyed = asyncio.run(verdict('{"reward": 0.75, "style": 1}'))
    assert keyed.reward == 0.75 and keyed.rewards == {"reward": 0.75, "style": 1.0}
    assert asyncio.run(verdict('{"correctness": 1}')).rewards is None
    bad = asyncio.run(verdict('{"correctness": "yes"}'))
    assert (bad.reward, bad.status) == (None, "bad_reward")
