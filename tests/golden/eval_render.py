"""Render the golden sbatch text of `miles eval --submit` jobs (machine-independent).

Regenerate after an intended change (then review the diff):

    .venv/bin/python tests/golden/eval_render.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launcher_render import REPO, launcher  # noqa: E402

GOLDEN = Path(__file__).resolve().parent / "eval"

CASES = {
    "deepseek-v4-flash__mi355x__step20": ("deepseek", "mi355x", 20, None, None),
    "slurm-tiny__local__step4__external": (
        "recipes/slurm-tiny.yaml",
        "local",
        4,
        "external",
        "my_evals:aime",
    ),
}
"""name -> (recipe, or `deepseek` for the launcher's recipe; profile; step; --mode; --fn)."""


def render(name: str) -> str:
    """The sbatch text of one case, with the repo path replaced by <repo>."""
    from miles.launch.eval_job import build_eval_job
    from miles.launch.slurm import render_sbatch
    from miles.launch.submit import load_plan

    recipe, profile, step, mode, fn = CASES[name]
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        source = launcher("deepseek_v4_flash").RECIPE if recipe == "deepseek" else str(REPO / recipe)
        plan, prof = load_plan(source, profile, ["run.runs_root=/shared/runs"])
        spec = build_eval_job(plan, prof, plan.run_dir, step, mode=mode, fn=fn, python="python")
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
