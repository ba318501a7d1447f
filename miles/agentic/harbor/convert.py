"""`miles tasks convert SRC... --out DIR`: Terminal-Bench 1 tasks rewritten in Harbor's format.

Terminal-Bench 1 (the format before Harbor) keeps a task as:

    task.yaml            instruction (or descriptions[].description), author_*, difficulty, category,
                         tags, max_agent_timeout_sec, max_test_timeout_sec, ...
    Dockerfile           the environment, its build context the task folder itself
    docker-compose.yaml  the service that builds it (a `client`; further services: sidecars)
    solution.sh          the oracle (or solution.yaml: a list of {command: ...} typed into a shell)
    run-tests.sh         the verifier (optional: pytest over tests/test_outputs.py by default)
    tests/               its files, copied to $TEST_DIR (/tests) for verification only

and scores a trial by the tests' exit status. The Harbor task written here: instruction.md,
task.toml ([metadata] from the YAML's fields, [agent] / [verifier] timeouts),
environment/Dockerfile with the rest of the folder as its context, solution/solve.sh, and
tests/test.sh, which runs run-tests.sh with TEST_DIR=/tests and writes its exit status as the reward
(1 when it exits 0). Terminal-Bench 1's harness supplied two helper scripts to run-tests.sh,
setup-uv-pytest.sh and run-uv-pytest.sh; the converted tests/ gets stand-ins of its own that use the
image's pytest (installing it with pip when it can) or, without one, call each test function of
tests/test_outputs.py in turn. A compose file with services beyond the one
that builds the Dockerfile is refused: Miles runs one container per episode.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from miles.agentic.harbor.files import TaskError

SKIP = {"task.yaml", "solution.sh", "solution.yaml", "run-tests.sh", "tests", "docker-compose.yaml",
        "docker-compose.yml", "Dockerfile"}  # fmt: skip
"""What of a Terminal-Bench 1 task folder is not the environment's build context."""
_PLAIN_RUNNER = """import importlib.util, sys, traceback
spec = importlib.util.spec_from_file_location("test_outputs", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
failed = 0
for name in sorted(n for n in dir(module) if n.startswith("test_") and callable(getattr(module, n))):
    try:
        getattr(module, name)()
        print("PASSED", name)
    except Exception:
        failed += 1
        print("FAILED", name)
        traceback.print_exc()
sys.exit(1 if failed else 0)
"""
HELPERS = {
    "setup-uv-pytest.sh": "python3 -m pytest --version >/dev/null 2>&1 || "
    "python3 -m pip install -q --retries 0 --timeout 5 pytest >/dev/null 2>&1 || true\n",
    "run-uv-pytest.sh": "if python3 -m pytest --version >/dev/null 2>&1; then\n"
    '  python3 -m pytest "$TEST_DIR/test_outputs.py" -rA\n'
    "else  # no pytest in the image: each test_* function of test_outputs.py, called in turn\n"
    "  python3 - \"$TEST_DIR/test_outputs.py\" <<'PY'\n" + _PLAIN_RUNNER + "PY\nfi\n",
}
"""Stand-ins of the Terminal-Bench 1 harness's helper scripts (module docstring): pytest where the image
has it (or pip can install it), else the test functions called one by one (plain asserts)."""
DEFAULT_RUN_TESTS = 'source "$TEST_DIR/setup-uv-pytest.sh"\nbash "$TEST_DIR/run-uv-pytest.sh"\n'
TEST_SH = """#!/bin/bash
# Terminal-Bench 1's verifier (run-tests.sh) scored by its exit status, as its harness did.
export TEST_DIR=/tests
mkdir -p /logs/verifier
cd /app 2>/dev/null || true
bash /tests/run-tests.sh
if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
"""


def is_tb1(path: Path) -> bool:
    """Whether `path` holds a Terminal-Bench 1 task (task.yaml, no task.toml)."""
    return (path / "task.yaml").is_file() and not (path / "task.toml").exists()


def _meta(src: Path) -> dict[str, Any]:
    import yaml

    try:
        meta = yaml.safe_load((src / "task.yaml").read_text())
    except yaml.YAMLError as e:
        raise TaskError(f"{src / 'task.yaml'}: not YAML ({e})") from None
    if not isinstance(meta, dict):
        raise TaskError(f"{src / 'task.yaml'}: a mapping of fields is expected")
    return meta


def _instruction(src: Path, meta: dict[str, Any]) -> str:
    text = meta.get("instruction")
    if not text:  # the oldest layout: descriptions: [{key: base, description: ...}]
        base = [d for d in meta.get("descriptions") or [] if isinstance(d, dict) and d.get("description")]
        text = base[0]["description"] if base else ""
    if not str(text).strip():
        raise TaskError(f"{src / 'task.yaml'}: no instruction (neither `instruction` nor `descriptions`)")
    return str(text).strip() + "\n"


def _toml(meta: dict[str, Any]) -> str:
    def q(v: Any) -> str:
        return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'

    lines = ['version = "1.0"', "", "[metadata]"]
    for key in ("author_name", "author_email", "difficulty", "category"):
        if meta.get(key) is not None:
            lines.append(f"{key} = {q(meta[key])}")
    if meta.get("tags"):
        lines.append("tags = [" + ", ".join(q(t) for t in meta["tags"]) + "]")
    lines += ["", "[verifier]", f"timeout_sec = {float(meta.get('max_test_timeout_sec') or 180.0)}"]
    lines += ["", "[agent]", f"timeout_sec = {float(meta.get('max_agent_timeout_sec') or 360.0)}"]
    lines += ["", "[environment]", "build_timeout_sec = 600.0", ""]
    return "\n".join(lines)


def _solution(src: Path) -> str | None:
    if (src / "solution.sh").is_file():
        return (src / "solution.sh").read_text()
    if not (src / "solution.yaml").is_file():
        return None
    import yaml

    steps = yaml.safe_load((src / "solution.yaml").read_text()) or []
    cmds = [s["command"] if isinstance(s, dict) else str(s) for s in steps]
    if not all(isinstance(c, str) for c in cmds):
        raise TaskError(f"{src / 'solution.yaml'}: each entry needs a `command`")
    return "#!/bin/bash\n" + "".join(c.rstrip("\n") + "\n" for c in cmds)


def _check_compose(src: Path) -> None:
    import yaml

    for name in ("docker-compose.yaml", "docker-compose.yml"):
        if (src / name).is_file():
            services = (yaml.safe_load((src / name).read_text()) or {}).get("services") or {}
            if len(services) > 1:
                raise TaskError(
                    f"{src / name}: {len(services)} services ({', '.join(services)}); Miles runs one container "
                    "per episode, so a task with sidecars (docker compose) is not converted"
                )


def convert_tb1(src: Path, out: Path) -> Path:
    """Write the Harbor form of the Terminal-Bench 1 task `src` to out/<its name>; TaskError naming the
    file and what is wrong otherwise."""
    if not is_tb1(src):
        raise TaskError(f"{src}: not a Terminal-Bench 1 task (task.yaml without task.toml)")
    if not (src / "Dockerfile").is_file():
        raise TaskError(f"{src}: no Dockerfile (a compose-only environment is not converted)")
    _check_compose(src)
    meta = _meta(src)
    dst = out / src.name
    if dst.exists():
        raise TaskError(f"{dst} exists: choose another --out or remove it")
    (dst / "environment").mkdir(parents=True)
    (dst / "instruction.md").write_text(_instruction(src, meta))
    (dst / "task.toml").write_text(_toml(meta))
    shutil.copyfile(src / "Dockerfile", dst / "environment" / "Dockerfile")
    for item in src.iterdir():
        if item.name not in SKIP:
            copy = shutil.copytree if item.is_dir() else shutil.copyfile
            copy(item, dst / "environment" / item.name)
    if (solution := _solution(src)) is not None:
        (dst / "solution").mkdir()
        (dst / "solution" / "solve.sh").write_text(solution)
    tests = dst / "tests"
    shutil.copytree(src / "tests", tests) if (src / "tests").is_dir() else tests.mkdir()
    run = src / "run-tests.sh"
    (tests / "run-tests.sh").write_text(run.read_text() if run.is_file() else DEFAULT_RUN_TESTS)
    for name, body in HELPERS.items():
        if not (tests / name).exists():
            (tests / name).write_text(body)
    (tests / "test.sh").write_text(TEST_SH)
    return dst


def convert_paths(paths: list[str], out: str) -> list[tuple[str, str]]:
    """(source, result) per Terminal-Bench 1 task under `paths` (a task or a folder of them): the
    written task's path, or "error: ..." naming why it was not converted."""
    rows = []
    for p in map(Path, paths):
        tasks = (
            [p]
            if is_tb1(p)
            else sorted(d for d in p.iterdir() if d.is_dir() and is_tb1(d))
            if p.is_dir()
            else []
        )
        if not tasks:
            rows.append((str(p), "error: neither a Terminal-Bench 1 task (task.yaml) nor a folder of them"))
        for t in tasks:
            try:
                rows.append((str(t), str(convert_tb1(t, Path(out)))))
            except (TaskError, OSError) as e:
                rows.append((str(t), f"error: {e}"))
    return rows
