"""Sandboxes where agentic tools run: the protocol (base.py), the local bubblewrap backend (bwrap.py),
cluster container command lines (container.py) and a pool with start-ahead (pool.py)."""

from miles.agentic.sandbox.base import ExecResult, Limits, Sandbox, SandboxError, SandboxStartError

__all__ = ["ExecResult", "Limits", "Sandbox", "SandboxError", "SandboxStartError"]
