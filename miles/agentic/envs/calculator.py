"""`calculator`: multi-step integer arithmetic the model must solve with a `calc` tool, then answer.

A task is an expression such as `47*38+65` (operands up to `max_operand`, `num_ops` operations), too
long for a small model to compute in its head, so an episode takes two turns at least:

    user:      47*38+65
    assistant: <tool_call>calc 47*38+65</tool_call>          (or the JSON form)
    tool:      1851
    assistant: 1851                                           -> reward 1.0, done

The final answer is the last integer in the assistant's text; reward 1.0 when it equals the value,
else 0.0. `calc` evaluates with a safe evaluator (an AST walk over integers, + - * // % and small
powers; never `eval`). With `backend="sandbox"` the expression instead runs as `python3 -c` inside
a sandbox made for the episode (any Python expression, isolated, killed at the tool's time limit).
"""

from __future__ import annotations

import ast
import operator
import random
import re
from collections.abc import Callable
from typing import Any

from miles.agentic.envs.base import Message
from miles.agentic.envs.toolenv import ToolEnv
from miles.agentic.envs.tools import Tool, ToolError

_BINOPS: dict[type, Callable[[int, int], int]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
MAX_EXPR_CHARS = 200
MAX_ABS = 10**30
_INT = re.compile(r"-?\d+")


def safe_eval(expr: str) -> int:
    """The integer value of an arithmetic expression; ToolError for anything else or anything too big."""
    if len(expr) > MAX_EXPR_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError:
        raise ToolError(f"cannot parse {expr.strip()!r}") from None
    return _value(tree.body)


def _value(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        value = node.value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = -_value(node.operand) if isinstance(node.op, ast.USub) else _value(node.operand)
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and not (0 <= right <= 64):
            raise ToolError("powers take exponents 0..64")
        if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and right == 0:
            raise ToolError("division by zero")
        value = _BINOPS[type(node.op)](left, right)
    elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        raise ToolError("integers only: use // for division")
    else:
        raise ToolError(f"only integers and + - * // % ** are allowed (got {type(node).__name__})")
    if abs(value) > MAX_ABS:
        raise ToolError("number too large")
    return value


def last_int(text: str) -> int | None:
    """The last integer written in `text`, if any."""
    found = _INT.findall(text)
    return int(found[-1]) if found else None


class CalculatorEnv(ToolEnv):
    """Arithmetic with a calculator tool; see the module docstring."""

    name = "calculator"

    def __init__(
        self,
        num_ops: int = 2,
        max_operand: int = 99,
        ops: str = "+-*",
        max_turns: int = 4,
        tool_timeout_s: float = 5.0,
        backend: str = "safe",
        sandbox: Any = None,
        prompt_prefix: str = "",
    ) -> None:
        super().__init__(max_turns)
        if num_ops < 1 or max_operand < 2 or not ops or set(ops) - set("+-*"):
            raise ValueError("calculator: num_ops >= 1, max_operand >= 2 and ops a subset of '+-*' please")
        if backend not in ("safe", "sandbox"):
            raise ValueError(f"calculator: backend must be 'safe' or 'sandbox' (got {backend!r})")
        self.num_ops, self.max_operand, self.ops = num_ops, max_operand, ops
        self.backend, self.prompt_prefix, self.tool_timeout_s = backend, prompt_prefix, tool_timeout_s
        self._sandboxes = SandboxHolder(sandbox) if backend == "sandbox" else None
        self._tools = {
            "calc": Tool(
                "calc",
                "Evaluate an integer arithmetic expression and return its value.",
                {"expr": {"type": "string", "description": "the expression, e.g. 47*38+65"}},
                self._calc,
                # in a sandbox the command's own limit (tool_timeout_s) fires first; this is the backstop
                timeout_s=tool_timeout_s + (1.0 if backend == "sandbox" else 0.0),
            )
        }

    def make_task(self, seed: int, index: int) -> dict[str, Any]:
        rng = random.Random(f"calculator:{seed}:{index}")
        parts = [str(rng.randint(2, self.max_operand))]
        for _ in range(self.num_ops):
            parts += [rng.choice(self.ops), str(rng.randint(2, self.max_operand))]
        expr = "".join(parts)
        return {"id": index, "expr": expr, "answer": safe_eval(expr)}

    def opening(self, task: dict[str, Any]) -> list[Message]:
        return [{"role": "user", "content": f"{self.prompt_prefix}{task['expr']}"}]

    def grade(self, answer: str) -> float:
        return float(last_int(answer) == int(self.task["answer"]))

    async def setup(self) -> None:
        if self._sandboxes is not None:
            await self._sandboxes.open()

    async def close(self) -> None:
        if self._sandboxes is not None:
            await self._sandboxes.close()

    async def _calc(self, expr: str) -> str:
        if self._sandboxes is None:
            return str(safe_eval(expr))
        return await self._sandboxes.python_expr(expr, self.tool_timeout_s)


class SandboxHolder:
    """One sandbox per episode for a tool: made by `factory` (a callable returning an unopened
    Sandbox) or, given a dict or None, a local bubblewrap sandbox with those settings."""

    def __init__(self, factory: Any) -> None:
        self.factory = factory
        self.sandbox: Any = None

    async def open(self, attempts: int = 3) -> None:
        """Start the episode's sandbox, trying `attempts` times; then SandboxStartError (the episode
        is dropped with the reason counted, miles/agentic/rollout.py)."""
        from miles.agentic.sandbox.base import SandboxStartError

        last: Exception | None = None
        for _ in range(attempts):
            if callable(self.factory):
                self.sandbox = self.factory()
            else:
                from miles.agentic.sandbox.bwrap import BwrapSandbox, BwrapSettings

                self.sandbox = BwrapSandbox(BwrapSettings(**(self.factory or {})))
            try:
                await self.sandbox.create()
                return
            except Exception as e:  # noqa: BLE001 - any failure to start is retried, then reported
                last = e
                await self.close()
        reason = last.reason if isinstance(last, SandboxStartError) else type(last).__name__
        raise SandboxStartError(reason, f"gave up after {attempts} attempts: {last}")

    async def close(self) -> None:
        sandbox, self.sandbox = self.sandbox, None
        if sandbox is not None:
            await sandbox.close()

    async def python_expr(self, expr: str, timeout_s: float) -> str:
        """Print the value of a Python expression run in the sandbox; ToolError on failure."""
        code = f"print({expr})"
        result = await self.sandbox.exec(["python3", "-c", code], timeout_s=timeout_s)
        if result.timed_out or result.killed_reason:
            raise ToolError(f"stopped: {result.killed_reason or 'time limit'}")
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["failed"])[-1]
            raise ToolError(last[:200])
        return result.stdout.strip()[:200]
