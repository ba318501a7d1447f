"""Tasks written by strangers and verifiers that lie: links and special files out of a task directory
are refused by the reader and by the episode runner, naming the path; a reward file that is a link is
not followed; rewards that are not finite or outside the task's declared range mask the sample; the
producer masks a non-finite reward from any reward function and counts it by reason."""

from __future__ import annotations

import asyncio
import math
import os
import shutil
from pathlib import Path

import pytest

from miles.agentic.harbor.episode import Episode
from miles.agentic.harbor.task import TaskError, load_task
from miles.rollout.buffer import RolloutBuffer
from miles.rollout.producer import Producer, ProducerStats
from miles.sample import Sample

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


def _task(root: Path, test_sh: str = "echo 1 > /logs/verifier/reward.txt\n", toml: str = "") -> Path:
    for rel, text in {
        "task.toml": toml or "[verifier]\ntimeout_sec = 30\n",
        "instruction.md": "Do nothing.\n",
        "environment/Dockerfile": "FROM x\nWORKDIR /app\n",
        "tests/test.sh": test_sh,
    }.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


@pytest.mark.parametrize("kind", ["symlink_out", "dangling", "hard_link", "fifo"])
def test_links_and_special_files_out_of_a_task_are_refused_naming_them(tmp_path, kind) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret\n")
    secret.chmod(0o600)
    task = _task(tmp_path / "t")
    planted = task / "tests" / "helper.txt"
    if kind == "symlink_out":
        planted.symlink_to(secret)
    elif kind == "dangling":
        planted.symlink_to(tmp_path / "nowhere")
    elif kind == "hard_link":
        os.link(secret, planted)
    else:
        os.mkfifo(planted)
    with pytest.raises(TaskError, match="helper.txt"):
        load_task(task)


def test_a_link_inside_the_task_is_fine(tmp_path) -> None:
    task = _task(tmp_path / "t")
    (task / "tests" / "alias.sh").symlink_to(task / "tests" / "test.sh")
    assert load_task(task).name == "t"


@needs_bwrap
def test_the_episode_runner_refuses_a_link_planted_after_loading(tmp_path) -> None:
    """A task checked at load time and changed before its verifier runs: the copy refuses it too."""
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret\n")
    task = load_task(_task(tmp_path / "t"))
    (task.path / "tests" / "test.sh").unlink()
    (task.path / "tests" / "test.sh").symlink_to(secret)

    async def go():
        async with Episode(task) as ep:
            return await ep.verify()

    with pytest.raises(TaskError, match="test.sh"):
        asyncio.run(go())


@needs_bwrap
@pytest.mark.parametrize(
    "written, toml, status",
    [
        ("nan", "", "bad_reward"),
        ("inf", "", "bad_reward"),
        ("-5", "[verifier]\nreward_range = [0.0, 1.0]\n", "bad_reward"),
        ("1e9", "[verifier]\nreward_range = [0.0, 1.0]\n", "bad_reward"),
        ("0.5", "[verifier]\nreward_range = [0.0, 1.0]\n", "ok"),
    ],
)
def test_a_verifiers_reward_must_be_finite_and_in_range(tmp_path, written, toml, status) -> None:
    task = load_task(_task(tmp_path / "t", f"echo {written} > /logs/verifier/reward.txt\n", toml))

    async def go():
        async with Episode(task) as ep:
            return await ep.verify()

    result = asyncio.run(go())
    assert result.status == status, result.output
    assert (result.reward is None) == (status != "ok")


@needs_bwrap
def test_a_reward_file_linked_to_a_host_file_is_not_read(tmp_path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("0.75\n")
    task = load_task(_task(tmp_path / "t", f"ln -s {secret} /logs/verifier/reward.txt\n"))

    async def go():
        async with Episode(task) as ep:
            return await ep.verify()

    result = asyncio.run(go())
    assert result.reward is None and result.status == "bad_reward"


def test_the_producer_masks_non_finite_rewards_and_counts_them_by_reason() -> None:
    producer = Producer.__new__(Producer)  # only the group bookkeeping is exercised
    producer.stats, producer.teacher, producer.buffer = ProducerStats(), None, RolloutBuffer(capacity=8)
    producer.masked_in_a_row, producer.max_masked_groups, producer.error, producer.inflight_groups = (
        0,
        0,
        None,
        1,
    )
    rewards = [1.0, math.nan, math.inf, 0.0]
    samples = [
        Sample(group_id=0, index=i, prompt_ids=[1], response_ids=[2], reward=r) for i, r in enumerate(rewards)
    ]

    async def one(s: Sample) -> list[Sample]:
        return [s]

    async def go():
        await producer._group(None, 0, [asyncio.ensure_future(one(s)) for s in samples])

    asyncio.run(go())
    assert producer.error is None
    (group,) = producer.buffer.get(1, current_version=0, timeout_s=1.0)
    assert [s.reward for s in group] == [1.0, 0.0]  # the two finite ones go on to training
    metrics = producer.stats.take()
    assert metrics["rollout/masked_samples"] == 2.0
    assert metrics["rollout/masked_reward_not_finite"] == 2.0


@needs_bwrap
def test_miles_tasks_check_gives_a_refused_task_a_row_of_its_own(tmp_path) -> None:
    import subprocess
    import sys

    secret = tmp_path / "secret.txt"
    secret.write_text("host secret\n")
    good = _task(tmp_path / "set" / "a-good", "mkdir -p /logs/verifier; echo 0 > /logs/verifier/reward.txt\n")
    bad = _task(tmp_path / "set" / "b-linked")
    (bad / "tests" / "data.txt").symlink_to(secret)
    out = subprocess.run([sys.executable, "-m", "miles", "tasks", "check", str(tmp_path / "set")],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 1, out.stdout + out.stderr
    rows = {line.split()[0]: line for line in out.stdout.splitlines()[1:-1]}
    assert set(rows) == {good.name, bad.name}, out.stdout
    assert "data.txt" in rows[bad.name] and "outside the task directory" in rows[bad.name]
    assert "host secret" not in out.stdout + out.stderr
    assert "1/2 tasks passed" in out.stdout
