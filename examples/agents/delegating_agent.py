#!/usr/bin/env python3
"""A black-box agent: a small command-line program that knows nothing of Miles but an OpenAI base_url.

    OPENAI_BASE_URL=http://.../sessions/<id>/v1 python3 delegating_agent.py < task.txt

It reads the task from standard input and makes a first attempt, delegates the task to a sub-agent (a
session of its own, opened with `POST {base_url}/subagents`), then compacts its context: the final
question is the task and the sub-agent's reply, without its own first attempt. It prints the final
answer as its last line. Miles' session server records all of it: the first attempt and the compacted
history are two branches of the agent's session (an edited history forks), the sub-agent's conversation
a third, and all three are trained on as trajectories of one episode. Run by
`miles.agentic.program:program_agent`.
"""

from __future__ import annotations

import os
import sys

import httpx
from openai import OpenAI

MAX_TOKENS = int(os.environ.get("AGENT_MAX_TOKENS", "1"))


def main() -> int:
    task = sys.stdin.read().strip()
    base_url = os.environ["OPENAI_BASE_URL"]
    model = os.environ.get("AGENT_MODEL", "policy")
    main_agent = OpenAI(base_url=base_url, api_key="unused")
    first = main_agent.chat.completions.create(
        model=model, messages=[{"role": "user", "content": task}], max_tokens=MAX_TOKENS
    )
    attempt = first.choices[0].message.content or ""
    sub = httpx.post(f"{base_url}/subagents", json={"metadata": {"role": "solver"}}, timeout=30).json()
    solver = OpenAI(base_url=sub["base_url"], api_key="unused")
    draft = solver.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": f"{task}\nA first attempt says: {attempt}"}],
        max_tokens=MAX_TOKENS,
    )
    hint = draft.choices[0].message.content or ""
    # compaction: the history is rewritten to the task and the helper's reply only
    final = main_agent.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": f"{task}\nThe helper says: {hint}"}],
        max_tokens=MAX_TOKENS,
    )
    print(final.choices[0].message.content or "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
