"""Render the golden sbatch text of the launchers' full-scale recipes (machine-independent), through
render.py's renderer.

Regenerate after an intended change (then review the diff):

    .venv/bin/python tests/golden/launcher_render.py
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

sys.path.insert(0, str(Path(__file__).resolve().parent))
from render import REPO  # noqa: E402
from render import render as render_recipe  # noqa: E402

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
    """The sbatch text of one case."""
    module, profile = CASES[name]
    return render_recipe(launcher(module).RECIPE, profile)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    GOLDEN.mkdir(parents=True, exist_ok=True)
    for case in CASES:
        path = GOLDEN / f"{case}.sh"
        path.write_text(render(case))
        print(path.relative_to(REPO))
