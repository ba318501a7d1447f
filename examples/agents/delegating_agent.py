#!/usr/bin/env python3
"""A black-box agent: a small command-line program that knows nothing of Miles but an OpenAI base_url.

    OPENAI_BASE_URL=http://.../sessions/<id>/v1 python3 delegating_agent.py < task.txt

It reads the task from standard input, delegates it to a sub-agent (a session of its own, opened with
`POST {base_url}/subagents`), then asks its own model for the final answer given the sub-agent's reply,
and prints that answer as its last line. Both conversations are recorded by Miles' session server and
trained on as trajectories of one episode. Run by `miles.agentic.program:program_agent`.
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
    sub = httpx.post(f"{base_url}/subagents", json={"metadata": {"role": "solver"}}, timeout=30).json()
    solver = OpenAI(base_url=sub["base_url"], api_key="unused")
    draft = solver.chat.completions.create(
        model=model, messages=[{"role": "user", "content": task}], max_tokens=MAX_TOKENS
    )
    hint = draft.choices[0].message.content or ""
    main_agent = OpenAI(base_url=base_url, api_key="unused")
    final = main_agent.chat.completions.create(
        model=model,
        messages=[
            {"role": "user", "content": task},
            {"role": "assistant", "content": "Asking a helper."},
            {"role": "user", "content": f"The helper says: {hint}"},
        ],
        max_tokens=MAX_TOKENS,
    )
    print(final.choices[0].message.content or "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
