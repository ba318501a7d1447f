"""`program_agent`: an external program as the agent (its environment, its answer scored by the reward
function, failures and timeouts) without a model: the programs here answer by themselves."""

from __future__ import annotations

import asyncio
import json
import sys
import time

import pytest

from miles.agentic.program import program_agent
from miles.config import resolve

TASK = {"prompt": "last digit: 3 8", "answer": 8, "id": 4}


def _run(code: str, **options):
    command = f"{sys.executable} -c {json.dumps(code)}"
    return asyncio.run(program_agent(TASK, "http://127.0.0.1:1/sessions/x/v1", command=command, **options))


def test_the_program_sees_its_base_url_and_task_and_its_last_line_is_scored() -> None:
    code = (
        "import os, sys, json; t = json.loads(os.environ['MILES_TASK']); "
        "assert os.environ['OPENAI_BASE_URL'].endswith('/sessions/x/v1'); "
        "assert sys.stdin.read() == 'last digit: 3 8'; print('thinking...'); print(t['answer'])"
    )
    assert _run(code) == {"reward": 1.0}
    assert _run("print(7)") == {"reward": 0.0}


def test_a_failing_or_hanging_program_fails_the_episode() -> None:
    with pytest.raises(RuntimeError, match="exited with 3: .*boom"):
        _run("import sys; sys.stderr.write('boom'); sys.exit(3)")
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="ran past 1 s"):
        _run("import time; time.sleep(30)", timeout_s=1.0)
    assert time.monotonic() - start < 10
    with pytest.raises(ValueError, match="agent_options.command is empty"):
        asyncio.run(program_agent(TASK, "http://x"))


def test_agent_options_are_a_recipe_key() -> None:
    plan = resolve(
        {"rollout": {"agent_fn": "miles.agentic.program:program_agent", "agent_options": {"command": "a b"}}}
    )
    assert plan.rollout.agent_options == {"command": "a b"}
