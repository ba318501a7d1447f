"""`miles train` and `miles submit` refuse the same parallel layouts, with the same message, before any
process starts: resolve() for local runs (over train.num_ranks), the pre-submission check for Slurm
(over the actor group's ranks), both through miles.config.layout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from miles.config import ConfigError, resolve
from miles.launch.spec import check
from miles.launch.submit import load_plan

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "recipes" / "slurm-tiny.yaml")


def _train_error(overrides: list[str]) -> str:
    """The message `miles train` stops with (the plan is resolved for this host)."""
    with pytest.raises(ConfigError) as e:
        resolve({}, overrides)
    return str(e.value)


def _submit_error(overrides: list[str], profile: str = "h200") -> str:
    """The message `miles submit` stops with (the slurm-tiny recipe: 2 actor nodes, 16 ranks on h200)."""
    with pytest.raises(ConfigError) as e:
        plan, prof = load_plan(TINY, profile, overrides)
        check(plan, prof)
    return str(e.value)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.tensor_parallel=3"], "train.tensor_parallel=3 is not supported by train.backend=fsdp ("),
        (["train.tensor_parallel=2"], "train.backend=megatron splits layers); set train.tensor_parallel=1"),
        (["train.pipeline_parallel=2"], "train.pipeline_parallel=2 is not supported by train.backend=fsdp"),
        (["train.expert_parallel=2"], "train.expert_parallel=2 is not supported by train.backend=fsdp ("),
        (
            ["train.backend=megatron", "train.pipeline_last_stage_layers=2"],
            "train.pipeline_last_stage_layers sizes a pipeline stage, and train.pipeline_parallel=1",
        ),
        (["train.backend=megatron", "train.pipeline_parallel=0"], "train.pipeline_parallel must be >= 1"),
        (["train.backend=megatron", "train.device=cpu"], "train.backend=megatron runs on CUDA GPUs only"),
    ],
)
def test_train_and_submit_refuse_the_same_layout(overrides: list[str], message: str) -> None:
    local, slurm = _train_error(overrides), _submit_error(overrides)
    assert message in local
    assert local == slurm


def test_rank_count_rule_names_the_key_of_each_launcher() -> None:
    megatron = ["train.backend=megatron", "train.tensor_parallel=3"]
    local = _train_error([*megatron, "train.num_ranks=4"])
    assert local == (
        "4 trainer ranks (train.num_ranks) are not a multiple of train.tensor_parallel x "
        "train.pipeline_parallel = 3: change train.num_ranks or those sizes"
    )
    slurm = _submit_error(megatron)
    assert slurm.startswith("16 trainer ranks (launch.actor_nodes x launch.actor_tasks_per_node)")
    rule = ") are not a multiple of train.tensor_parallel x train.pipeline_parallel = 3: change "
    assert rule in local and rule in slurm  # the same rule, in the same words


def test_valid_megatron_layouts_pass() -> None:
    plan = resolve({}, ["train.backend=megatron", "train.num_ranks=4", "train.tensor_parallel=2"])
    assert (plan.train.tensor_parallel, plan.train.num_ranks) == (2, 4)
    plan, prof = load_plan(
        TINY, "h200", ["train.backend=megatron", "train.tensor_parallel=2", "train.pipeline_parallel=4"]
    )
    assert check(plan, prof)["actor_ranks"] == 16


def test_submit_checks_the_actor_group_not_train_num_ranks() -> None:
    """On Slurm the actor group decides the ranks: train.num_ranks (a local-run key) does not refuse."""
    plan, prof = load_plan(
        TINY, "h200", ["train.backend=megatron", "train.num_ranks=1", "train.tensor_parallel=8"]
    )
    assert check(plan, prof)["actor_ranks"] == 16
    assert "launch.actor_nodes" in _submit_error(
        ["train.backend=megatron", "train.tensor_parallel=4", "launch.actor_tasks_per_node=3"]
    )


def test_megatron_on_a_cpu_profile_is_refused_by_submit_only() -> None:
    assert "profile 'local' has none" in _submit_error(
        ["train.backend=megatron", "train.device=auto"], profile="local"
    )
    assert resolve({}, ["train.backend=megatron"]).train.backend == "megatron"  # a GPU host may run it


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A model directory holding only config.json: 6 layers, 8 heads, 2 KV heads, vocabulary 1000."""
    cfg = {"num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 1000}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        (["train.tensor_parallel=4"], "num_key_value_heads=2, not divisible by train.tensor_parallel=4"),
        (["train.pipeline_parallel=4"], "num_hidden_layers=6, not divisible by train.pipeline_parallel=4"),
        (["train.tensor_parallel=8"], "num_key_value_heads=2, not divisible by train.tensor_parallel=8"),
    ],
)
def test_model_shape_rules(model_dir: Path, sizes: list[str], message: str) -> None:
    common = [f"model.path={model_dir}", "train.backend=megatron", "train.num_ranks=8"]
    with pytest.raises(ConfigError, match=message):
        resolve({}, [*common, *sizes])
    ok = resolve({}, [*common, "train.tensor_parallel=2", "train.pipeline_parallel=3", "train.num_ranks=6"])
    assert ok.train.pipeline_parallel == 3


def test_miles_train_stops_before_starting_anything(tmp_path: Path) -> None:
    """The whole command, through `python -m miles`: exit 2, the message, no run directory."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"run: {{name: layout, runs_root: {tmp_path / 'runs'}}}\ntrain: {{tensor_parallel: 3}}\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "miles", "train", str(recipe)], capture_output=True, text=True, cwd=tmp_path
    )
    assert out.returncode == 2, out.stderr
    assert "miles: error: train.tensor_parallel=3 is not supported by train.backend=fsdp" in out.stderr
    assert not (tmp_path / "runs").exists()
