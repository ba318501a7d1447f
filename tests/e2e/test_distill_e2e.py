"""On-policy distillation end to end on CPU: `miles train` of the default recipe with
train.distill.teacher_model (Miles starts the teacher's engine; a tiny model of another size with the
student's tokenizer) scores every group, reports the teacher's time and the reverse KL per step, and
stops the teacher with the rest; a teacher with another tokenizer is refused before anything starts."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import deep_update, finish, miles_train

from miles.metrics import read_metrics
from miles.models.tiny import init_tiny

pytestmark = pytest.mark.slow

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "default.yaml"
STEPS = 3


def _recipe(tmp_path: Path, student: str, teacher: str, name: str, mode: str = "logprob") -> Path:
    data = deep_update(
        yaml.safe_load(RECIPE.read_text()),
        {
            "run": {"name": name, "runs_root": str(tmp_path / "runs"), "tensorboard": False},
            "model": {"path": student, "init_tiny_if_missing": False},
            "eval": {"every_steps": 0},
            "train": {"steps": STEPS, "distill": {"teacher_model": teacher, "coef": 1.0, "mode": mode}},
        },
    )
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("mode", ["logprob", "topk_reverse_kl"])
def test_distillation_from_a_teacher_engine(tmp_path, tiny_model, mode):
    teacher = str(init_tiny(tmp_path / "teacher", seed=0, hidden_size=96, num_hidden_layers=3))
    finish(miles_train(str(_recipe(tmp_path, tiny_model, teacher, "opd", mode))), timeout_s=600)
    rows = [r for r in read_metrics(tmp_path / "runs" / "opd") if r["step"] > 0]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert r["time/teacher_s"] > 0
        assert math.isfinite(r["train/distill_reverse_kl"]) and r["train/distill_reverse_kl"] != 0.0
        if mode == "topk_reverse_kl":  # a KL over the top-k plus the rest: never negative
            assert r["train/distill_reverse_kl"] > 0
    assert (tmp_path / "runs" / "opd" / "logs" / "teacher-0.log").exists()


def test_a_teacher_with_another_tokenizer_is_refused_before_the_run(tmp_path, tiny_model):
    teacher = str(init_tiny(tmp_path / "other", seed=7))
    path = _recipe(tmp_path, tiny_model, teacher, "refused")
    out = subprocess.run(
        [sys.executable, "-m", "miles", "train", str(path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode != 0
    assert "train.distill.teacher_model" in out.stderr and "tokenizer" in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "runs" / "refused" / "logs" / "engine-0.log").exists()
