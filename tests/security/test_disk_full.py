"""A real `miles train` whose run directory is on a file system that fills up mid-run (a small tmpfs
mounted by the test): the run stops with a message naming the full file system on stderr and in a
log on another file system, and what was written before (metrics of finished steps) is intact."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from miles.metrics import read_metrics

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.slow


@pytest.fixture
def small_fs(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1200k", "tmpfs", str(mount)], capture_output=True
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_file_system_is_named_and_nothing_written_is_lost(small_fs, tmp_path, tiny_model) -> None:
    recipe = {
        "run": {"name": "full", "seed": 0, "tensorboard": False, "runs_root": str(small_fs)},
        "model": {"path": tiny_model, "init_tiny_if_missing": False},
        "rollout": {
            "task": {"name": "digits", "options": {"op": "last", "num_digits": 1}, "eval_size": 5},
            "reward": "miles.rollout.rewards:first_number",
            "prompts_per_step": 2,
            "n_samples_per_prompt": 2,
            "max_new_tokens": 3,
        },
        "eval": {"every_steps": 0},
        "train": {"steps": 6, "lr": 1e-3, "checkpoint": {"every_steps": 2}},
        "weights": {"transport": "distributed"},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    out = subprocess.run(
        [sys.executable, "-m", "miles.cli", "train", str(path)],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, TMPDIR=str(tmp_path)),
    )
    assert out.returncode != 0, out.stderr[-2000:]
    line = next((x for x in out.stderr.splitlines() if "is full" in x), None)
    assert line is not None and str(small_fs) in line, out.stderr[-3000:]
    found = re.search(r"this report is also in (\S+)\)", line)
    assert found, line
    report = Path(found.group(1))
    assert report.parent == tmp_path and "is full" in report.read_text()
    for record in read_metrics(small_fs / "full"):  # every line written is whole
        assert isinstance(record["step"], int)
