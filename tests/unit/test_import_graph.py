"""The import graph of the package has no cycle, counting imports inside functions (they run too) and
leaving out type-only imports under `if TYPE_CHECKING:`; read from the source with `ast`."""

from __future__ import annotations

import ast
from pathlib import Path

import miles

ROOT = Path(miles.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_nodes(tree: ast.AST):
    """Every node except those under an `if TYPE_CHECKING:` block."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The miles modules `path` imports at run time (`from pkg import submodule` names the submodule)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    paths = sorted(ROOT.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imports_of(p, modules) for p in paths}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path [a, b, ..., a], or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path, iters = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while path:
            nxt = next(iters[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                iters.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                iters.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_the_cycle_finder_finds_a_planted_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_reader_sees_function_level_imports_and_skips_type_only_ones(tmp_path) -> None:
    src = ROOT / "rollout" / "tasks.py"
    graph = import_graph()
    assert "miles.config" in graph[module_name(src)]
    assert "miles.eval.modes" in graph["miles.eval.runner"]
    assert len(graph) > 100


def test_the_package_has_no_import_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# Rooms that never import another room at run time (DESIGN.md: dependencies point down the house).
NEVER = [
    (("cluster", "agentic", "eval", "rollout", "engine", "train", "weights", "models", "quant"), "launch"),
    (("launch",), "eval"),
    (("models",), "agentic"),
]


def _room(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Edges of `graph` that NEVER forbids, as 'a -> b'."""
    found = []
    for source, targets in sorted(graph.items()):
        for target in sorted(targets):
            for rooms, forbidden in NEVER:
                if _room(source) in rooms and _room(target) == forbidden:
                    found.append(f"{source} -> {target}")
    return found


def test_the_never_list_finds_a_planted_upward_import() -> None:
    graph = {"miles.cluster.x": {"miles.launch.y"}, "miles.launch.y": {"miles.eval.z"}, "miles.eval.z": set()}
    assert upward_imports(graph) == ["miles.cluster.x -> miles.launch.y", "miles.launch.y -> miles.eval.z"]


def test_no_room_imports_a_room_above_it() -> None:
    assert upward_imports(import_graph()) == []


def test_what_miles_submit_needs_imports_no_torch(tmp_path) -> None:
    """The SGLang command builder, the plan-only quantisation contract, the loop's input checks and
    the submission layer import no torch, and a dry run of `miles submit` imports none either (login
    nodes have no torch)."""
    import subprocess
    import sys

    recipe = ROOT.parent / "recipes" / "default.yaml"
    code = (
        "import sys\n"
        "import miles.cli, miles.rollout.sglang, miles.rollout.engine_argv, miles.quant.contract\n"
        "import miles.loop.inputs, miles.launch.submit, miles.launch.eval_job, miles.launch.local\n"
        "assert 'torch' not in sys.modules, 'torch imported by an import'\n"
        "from miles.launch.submit import submit\n"
        f"submit({str(recipe)!r}, 'h100', ['run.runs_root={tmp_path}'], dry_run=True)\n"
        "assert 'torch' not in sys.modules, 'torch imported by a dry run'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
