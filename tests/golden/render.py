"""Render the golden sbatch text of one shipped recipe on one shipped profile (machine-independent).

Regenerate every golden file after an intended change (then review the diff):

    .venv/bin/python tests/golden/render.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parent / "sbatch"


def pairs() -> list[tuple[str, str]]:
    """(recipe path relative to the repo, profile name) for every shipped recipe x profile."""
    from miles.config.profile import known_profiles

    recipes = sorted(str(p.relative_to(REPO)) for p in (REPO / "recipes").glob("*.yaml"))
    return [(r, p) for r in recipes for p in known_profiles()]


def golden_path(recipe: str, profile: str) -> Path:
    return GOLDEN / f"{Path(recipe).stem}__{profile}.sh"


def render(recipe: str | dict, profile: str) -> str:
    """The sbatch text of a recipe (a path relative to the repo, or a recipe dict such as a launcher's
    RECIPE) on a profile, or the ConfigError a user would see; the repo path replaced by <repo>."""
    from miles.config import ConfigError
    from miles.launch.slurm import render_sbatch
    from miles.launch.spec import build_job
    from miles.launch.submit import load_plan

    cwd = os.getcwd()
    os.chdir(REPO)  # relative paths in recipes resolve against the repo root
    try:
        plan, prof = load_plan(recipe if isinstance(recipe, dict) else str(REPO / recipe), profile, [])
        text = render_sbatch(
            build_job(plan, prof, [plan.run_dir], log_dir=f"{plan.run_dir}/logs/slurm", python="python")
        )
    except ConfigError as e:
        text = f"ConfigError: {e}\n"
    finally:
        os.chdir(cwd)
    return text.replace(str(REPO), "<repo>")


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    GOLDEN.mkdir(parents=True, exist_ok=True)
    for old in GOLDEN.glob("*.sh"):
        old.unlink()
    for recipe, profile in pairs():
        golden_path(recipe, profile).write_text(render(recipe, profile))
        print(golden_path(recipe, profile).relative_to(REPO))
