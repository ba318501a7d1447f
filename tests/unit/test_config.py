"""The typed config: unknown keys, overrides, derivation, round trip, and no torch on import."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from miles.config import ConfigError, read_plan, resolve, write_plan


def test_unknown_key_names_nearest() -> None:
    with pytest.raises(ConfigError, match=r"rollout\.temprature.*rollout\.temperature"):
        resolve({"rollout": {"temprature": 0.5}})


def test_unknown_section_is_rejected() -> None:
    with pytest.raises(ConfigError, match="rolout"):
        resolve({"rolout": {}})


def test_override_wins_and_is_typed() -> None:
    plan = resolve({"rollout": {"temperature": 1.0}}, ["rollout.temperature=0.7", "train.steps=3"])
    assert plan.rollout.temperature == 0.7
    assert plan.train.steps == 3


def test_bad_type_names_key() -> None:
    with pytest.raises(ConfigError, match="train.steps"):
        resolve({}, ["train.steps=many"])


def test_malformed_override() -> None:
    with pytest.raises(ConfigError, match="section.key=value"):
        resolve({}, ["no-equals-sign"])


def test_derived_values(tmp_path) -> None:
    plan = resolve({"run": {"runs_root": str(tmp_path)}, "rollout": {"prompts_per_step": 3}})
    assert plan.rollout.buffer_capacity_groups == 6
    assert plan.train.loss.eps_clip_high == plan.train.loss.eps_clip


def test_cross_section_check() -> None:
    with pytest.raises(ConfigError, match="buffer_capacity_groups"):
        resolve({"rollout": {"prompts_per_step": 8, "buffer_capacity_groups": 4}})
    with pytest.raises(ConfigError, match="offload_dir"):
        resolve({"train": {"optimizer_offload": "nvme"}})


def test_plan_is_frozen() -> None:
    plan = resolve({})
    with pytest.raises(ValidationError):
        plan.train.steps = 5  # type: ignore[misc]


def test_round_trip(tmp_path) -> None:
    plan = resolve({"rollout": {"task": {"name": "digits"}}}, ["train.lr=0.01"])
    write_plan(plan, tmp_path / "plan.yaml")
    assert read_plan(tmp_path / "plan.yaml") == plan


def test_missing_recipe_file() -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        resolve("/nonexistent/recipe.yaml")


def test_config_and_launch_import_no_torch() -> None:
    code = "import sys, miles.config, miles.launch, miles.cli; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_colocated_layout_derives_the_tensor_transport() -> None:
    assert resolve({"launch": {"layout": "colocated"}}).weights.transport == "tensor"
    assert (
        resolve({"launch": {"layout": "colocated"}, "weights": {"transport": "disk"}}).weights.transport
        == "disk"
    )
    assert resolve({}).weights.transport == "distributed"
    with pytest.raises(ConfigError, match="set weights.transport=tensor"):
        resolve({"launch": {"layout": "colocated"}, "weights": {"transport": "distributed"}})


def test_plans_of_earlier_versions_still_read(tmp_path) -> None:
    """A retired key at its default (written by an earlier version) is dropped; a set one is refused."""
    import yaml

    data = resolve({}).model_dump(mode="json")
    data["launch"]["pipeline_last_stage_layers"] = None
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(data))
    assert read_plan(tmp_path / "plan.yaml") == resolve({})
    data["launch"]["pipeline_last_stage_layers"] = 10
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="unknown key 'launch.pipeline_last_stage_layers'"):
        read_plan(tmp_path / "plan.yaml")


def test_python_dash_m_miles_runs_the_cli() -> None:
    out = subprocess.run([sys.executable, "-m", "miles", "--help"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: miles") and "submit" in out.stdout and "train" in out.stdout
    out = subprocess.run([sys.executable, "-m", "miles", "nope"], capture_output=True, text=True)
    assert out.returncode == 2 and "invalid choice: 'nope'" in out.stderr


def test_off_is_a_word_in_recipes(tmp_path) -> None:
    """YAML 1.1 reads a bare `off` as False; recipes read it as the word (YAML 1.2 booleans), in the
    file and in --set overrides, and plan.yaml keeps it through a write and read."""
    from miles.config.loading import read_yaml

    recipe = tmp_path / "r.yaml"
    recipe.write_text("train:\n  loss: {tis: off}\nrun: {tensorboard: false}\n")
    data = read_yaml(recipe)
    assert data["train"]["loss"]["tis"] == "off" and data["run"]["tensorboard"] is False
    plan = resolve(data, ["train.loss.tis=off", "run.name=word"])
    assert plan.train.loss.tis == "off"
    write_plan(plan, tmp_path / "plan.yaml")
    assert read_plan(tmp_path / "plan.yaml").train.loss.tis == "off"
