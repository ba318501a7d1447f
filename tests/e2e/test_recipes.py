"""Every shipped recipe runs with one command from an empty directory: `miles train RECIPE` for one
training step (the tiny model it names is created on first use), and a dry-run `miles submit` for the
recipes meant for Slurm (they set node counts). Nothing is prepared beforehand: the working directory,
where the recipes' relative `runs/...` paths land, is a fresh temporary one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

RECIPES = sorted((Path(__file__).resolve().parents[2] / "recipes").glob("*.yaml"))

pytestmark = pytest.mark.slow


def _for_slurm(recipe: Path) -> bool:
    launch = (yaml.safe_load(recipe.read_text()) or {}).get("launch") or {}
    return "rollout_nodes" in launch or "actor_nodes" in launch


def _miles(args: list[str], cwd: Path, timeout: int) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    cmd = [sys.executable, "-m", "miles", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_recipes_are_found() -> None:
    assert len(RECIPES) >= 5 and any(r.name == "default.yaml" for r in RECIPES)


@pytest.mark.parametrize("recipe", [r for r in RECIPES if not _for_slurm(r)], ids=lambda r: r.stem)
def test_recipe_trains_one_step_from_nothing(recipe: Path, tmp_path: Path) -> None:
    overrides = ["train.steps=1", "train.checkpoint.every_steps=0", "run.tensorboard=false"]
    overrides.append(f"model.base_overrides=[{', '.join(overrides)}]")  # a base the recipe trains first
    if (yaml.safe_load(recipe.read_text()).get("model") or {}).get("tiny", {}).get("pretrain_steps"):
        overrides.append("model.tiny.pretrain_steps=50")  # the pretraining path runs, not its minute
    sets = [x for o in overrides for x in ("--set", o)]
    out = _miles(["train", str(recipe), *sets], tmp_path, timeout=420)
    assert out.returncode == 0, f"{recipe.name}: exit {out.returncode}\n{out.stderr[-3000:]}"
    plan = yaml.safe_load(next(tmp_path.glob("runs/*/plan.yaml")).read_text())
    model = (
        tmp_path / plan["model"]["path"]
        if not Path(plan["model"]["path"]).is_absolute()
        else Path(plan["model"]["path"])
    )
    arch = json.loads((model / "config.json").read_text())["model_type"]
    assert arch == plan["model"]["tiny"]["arch"], f"{recipe.name}: created a {arch} model"
    rows = [json.loads(line) for line in next(tmp_path.glob("runs/*/metrics.jsonl")).read_text().splitlines()]
    assert any(r.get("step") == 1 and "train/loss" in r for r in rows), f"{recipe.name}: no trained step 1"


@pytest.mark.parametrize("recipe", [r for r in RECIPES if _for_slurm(r)], ids=lambda r: r.stem)
def test_slurm_recipe_dry_run_submits_from_nothing(recipe: Path, tmp_path: Path) -> None:
    out = _miles(["submit", str(recipe), "--dry-run"], tmp_path, timeout=120)
    assert out.returncode == 0, f"{recipe.name}: exit {out.returncode}\n{out.stderr[-3000:]}"
    script = next(tmp_path.glob("runs/*/submission.sh")).read_text()
    assert "hetjob" in script and "srun" in script
