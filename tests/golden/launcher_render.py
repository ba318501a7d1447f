"""Render the golden sbatch text of the launchers' full-scale recipes (machine-independent).

Regenerate after an intended change (then review the diff):

    .venv/bin/python tests/golden/launcher_render.py
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parent / "launchers"

CASES = {"deepseek-v4-flash__mi355x": ("deepseek_v4_flash", "mi355x")}
"""name -> (launcher module in launchers/, profile)."""


def launcher(name: str) -> ModuleType:
    """A launcher script imported as a module (launchers/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "launchers" / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def render(name: str) -> str:
    """The sbatch text of one case, with the repo path replaced by <repo>."""
    from miles.launch.slurm import render_sbatch
    from miles.launch.spec import build_job
    from miles.launch.submit import load_plan

    module, profile = CASES[name]
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        plan, prof = load_plan(launcher(module).RECIPE, profile, ["run.runs_root=/shared/runs"])
        spec = build_job(plan, prof, [plan.run_dir], log_dir=f"{plan.run_dir}/logs/slurm", python="python")
        text = render_sbatch(spec)
    finally:
        os.chdir(cwd)
    return text.replace(str(REPO), "<repo>")


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    GOLDEN.mkdir(parents=True, exist_ok=True)
    for case in CASES:
        path = GOLDEN / f"{case}.sh"
        path.write_text(render(case))
        print(path.relative_to(REPO))
