"""Triton kernels on the CPU: a test file run as a script in a child interpreter with
TRITON_INTERPRET=1 (set in-process it would leak into every other kernel of the test session), which
prints one JSON line per case; `run_cases` collects them."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def run_cases(script: str, timeout_s: float = 600) -> dict:
    """{case: what the script measured} from running `script` under Triton's interpreter."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run(
        [sys.executable, script], env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return {
        k: v for line in out.stdout.splitlines() if line.startswith("{") for k, v in json.loads(line).items()
    }
