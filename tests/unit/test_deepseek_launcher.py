"""launchers/deepseek_v4_flash.py: the full-scale MI355X recipe (Megatron TP1 PP4 EP4, uneven stages,
R3, TIS), prepare-data, and the miniature (`--scale tiny`) rendered for Megatron and run on CPU."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles.config import read_plan
from miles.config.layout import stage_layers
from miles.config.rollout import TaskConfig
from miles.rollout.sglang import sglang_server_command

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "golden"))
from launcher_render import GOLDEN, launcher, render  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SCRIPT = str(REPO / "launchers" / "deepseek_v4_flash.py")
dsv4 = launcher("deepseek_v4_flash")


def test_full_scale_golden_sbatch() -> None:
    path = GOLDEN / "deepseek-v4-flash__mi355x.sh"
    assert path.exists(), f"missing golden file {path}: run .venv/bin/python tests/golden/launcher_render.py"
    assert render("deepseek-v4-flash__mi355x") == path.read_text(), f"{path} differs: review, then regenerate"


def test_full_scale_plan_has_the_reports_layout(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, SCRIPT, "train", "--dry-run", "--set", f"run.runs_root={tmp_path}"],
        capture_output=True, text=True, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "deepseek_v4 architecture (miles.train.megatron.deepseek_v4_model:ARCHITECTURE)" in out.stdout
    plan = read_plan(tmp_path / "deepseek-v4-flash" / "plan.yaml")
    t = plan.train
    layout = (t.backend, t.tensor_parallel, t.pipeline_parallel, t.expert_parallel)
    assert layout == ("megatron", 1, 4, 4), f"want Megatron TP1 PP4 EP4, got {layout}"
    first, last = t.pipeline_first_stage_layers, t.pipeline_last_stage_layers
    assert stage_layers(43, 4, first, last) == [11, 11, 11, 10], "43 layers with a 10-layer last stage"
    assert t.routing_replay == "rollout" and t.loss.tis == "truncate" and t.loss.old_logprobs == "recompute"
    assert t.optimizer_offload == "cpu", "the recipe keeps optimizer state in host memory"
    cmd = sglang_server_command(plan, host="0.0.0.0", port=30000)
    assert "--enable-return-routed-experts" in cmd, "R3 needs the SGLang servers to return routed experts"
    assert " ".join(cmd).count("--ep-size 8") == 1
    facts = json.loads((tmp_path / "deepseek-v4-flash" / "launch.json").read_text())
    assert facts["actor_ranks"] == 16, "2 actor nodes x 8 GPUs = PP4 x DP4 (EP4 over the DP4)"
    assert facts["eval_nodes"] == 0, "AMD's 4 nodes: no eval node unless --dedicated-eval"
    ev = plan.eval  # AIME every 10 steps on the rollout engines: AMD's 4 nodes
    assert ev.mode == "shared" and ev.every_steps == 10
    aime = ev.datasets["aime2024"]
    assert aime.source == "aime" and aime.samples == 8 and str(aime.path).endswith("aime-2024.jsonl")


def test_dry_runs_stay_under_the_local_runs_root_and_a_dedicated_eval_node_is_asked_for(
    tmp_path: Path,
) -> None:
    out = subprocess.run([sys.executable, SCRIPT, "train", "--dry-run", "--dedicated-eval"],
                         capture_output=True, text=True, cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stderr
    run = tmp_path / "runs" / "deepseek-v4-flash"
    assert read_plan(run / "plan.yaml").eval.mode == "dedicated"
    assert json.loads((run / "launch.json").read_text())["eval_nodes"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]  # nothing created anywhere else


@pytest.mark.parametrize(
    ("override", "names"),
    [
        ("train.expert_parallel=3", "train.expert_parallel=3 does not divide the 4 data-parallel"),
    ],
)
def test_full_scale_refuses_a_bad_layout(override: str, names: str, tmp_path: Path, capsys) -> None:
    rc = dsv4.main(["train", "--dry-run", "--set", f"run.runs_root={tmp_path}", "--set", override])
    err = capsys.readouterr().err
    assert rc == 2 and names in err, f"--set {override}: rc {rc}, stderr {err!r}"


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_prepare_data_generates_what_the_task_and_reward_read(tmp_path: Path) -> None:
    from miles.rollout.rewards import exact_match
    from miles.rollout.tasks import build_task
    from miles.sample import Sample

    dst = tmp_path / "data" / "train.jsonl"
    assert dsv4.main(["prepare-data", "--dst", str(dst), "--size", "12"]) == 0
    rows = _rows(dst)
    assert len(rows) == 12 and all(set(r) == {"prompt", "answer"} for r in rows), rows[:2]
    assert all("\\boxed{}" in r["prompt"] and r["answer"] == str(int(r["answer"])) for r in rows), rows[:2]
    first = dst.read_text()
    assert dsv4.main(["prepare-data", "--dst", str(dst), "--size", "12"]) == 0
    assert dst.read_text() == first, "generated data must be deterministic"
    task = build_task(TaskConfig(name="jsonl", path=str(dst), eval_size=2), seed=0)
    prompt = task.train_prompt(0)
    right = f"so \\boxed{{{prompt.answer}}}"
    sample = Sample(group_id=0, index=0, prompt_ids=[], answer=prompt.answer, response=right)
    assert exact_match(sample) == 1.0, "the recipe's default reward must score a right boxed answer"


def test_prepare_data_converts_a_source_file(tmp_path: Path) -> None:
    src = tmp_path / "src.jsonl"
    row = {"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "What is 2+3?"}]}
    src.write_text(json.dumps(row | {"reward_model": {"ground_truth": " 5 "}}) + "\n")
    dst = tmp_path / "train.jsonl"
    argv = ["prepare-data", "--src", str(src), "--dst", str(dst), "--answer-key", "reward_model.ground_truth"]
    assert dsv4.main(argv) == 0
    assert _rows(dst) == [{"prompt": "What is 2+3?", "answer": "5"}]
    with pytest.raises(SystemExit, match="no column 'solution' .*columns: prompt, reward_model"):
        dsv4.main(["prepare-data", "--src", str(src), "--dst", str(dst), "--answer-key", "solution"])
    with pytest.raises(SystemExit, match="--size is for generated rows"):
        dsv4.main(argv + ["--size", "3"])
    src.write_text(json.dumps({"prompt": [{"role": "system", "content": "s"}], "answer": "1"}) + "\n")
    with pytest.raises(SystemExit, match="no user message; set --prompt-key"):
        dsv4.main(["prepare-data", "--src", str(src), "--dst", str(dst)])
    assert dsv4.main(["prepare-data", "--src", str(tmp_path / "none.jsonl"), "--dst", str(dst)]) == 2
    assert _rows(dst) == [{"prompt": "What is 2+3?", "answer": "5"}], "refusals leave the file as it was"


def test_prepare_data_refuses_a_bad_destination(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="is a directory: give a file path"):
        dsv4.main(["prepare-data", "--dst", str(tmp_path)])
    with pytest.raises(SystemExit, match="give a path ending in .jsonl"):
        dsv4.main(["prepare-data", "--dst", str(tmp_path / "train.parquet")])
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit, match="cannot create its directory"):
        dsv4.main(["prepare-data", "--dst", str(tmp_path / "file" / "train.jsonl")])
    assert not list(tmp_path.glob("**/*.jsonl")), "nothing is written on a refused destination"


@pytest.mark.slow
def test_tiny_megatron_renders_ep_and_uneven_stages(tmp_path: Path, capsys) -> None:
    tiny = str(tmp_path / "tiny")
    assert (
        dsv4.main(["train", "--scale", "tiny", "--backend", "megatron", "--dry-run", "--tiny-dir", tiny]) == 0
    )
    plan = read_plan(tmp_path / "tiny" / "plan-megatron.yaml")
    t = plan.train
    assert (t.backend, t.num_ranks, t.pipeline_parallel, t.expert_parallel) == ("megatron", 4, 2, 2)
    config = json.loads((tmp_path / "tiny" / "model" / "config.json").read_text())
    assert config["model_type"] == "deepseek_v4" and config["num_hidden_layers"] == 5
    split = stage_layers(5, 2, t.pipeline_first_stage_layers, t.pipeline_last_stage_layers)
    assert split == [3, 2], f"the last stage one layer short, as at full scale; got {split}"
    assert t.routing_replay == "rollout" and t.loss.tis == "truncate"
    if importlib.util.find_spec("megatron") is not None:  # the stages the registered V4 modules build
        from transformers import AutoConfig

        from miles.train.megatron import deepseek_v4_model as V4

        cfg = AutoConfig.from_pretrained(tmp_path / "tiny" / "model")
        last = (t.pipeline_first_stage_layers, t.pipeline_last_stage_layers)
        assert [V4.stage_layers(cfg, 2, s, *last) for s in (0, 1)] == [range(0, 3), range(3, 5)]
    assert dsv4.main(["train", "--scale", "tiny", "--backend", "megatron", "--dry-run", "--tiny-dir", tiny,
                      "--gpus", "1"]) == 0  # fmt: skip
    t = read_plan(tmp_path / "tiny" / "plan-megatron.yaml").train
    assert (t.num_ranks, t.pipeline_parallel, t.expert_parallel) == (1, 1, 1), "one GPU: PP1 EP1"
    capsys.readouterr()
    bad = ["--set", "train.pipeline_last_stage_layers=1"]  # 5 - 3 - 1 = 1 layer left for no middle stage
    assert (
        dsv4.main(
            ["train", "--scale", "tiny", "--backend", "megatron", "--dry-run", "--tiny-dir", tiny, *bad]
        )
        == 2
    )
    assert "train.pipeline_last_stage_layers" in capsys.readouterr().err


@pytest.mark.slow
def test_tiny_runs_end_to_end_on_cpu(tmp_path: Path) -> None:
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, SCRIPT, "train", "--scale", "tiny", "--tiny-dir", str(tmp_path),
         *("--set", "train.steps=3", "--set", "eval.every_steps=3", "--set", "train.checkpoint.every_steps=3")],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads((tmp_path / "model" / "config.json").read_text())["model_type"] == "deepseek_v4"
    run = tmp_path / "runs" / "deepseek-v4-flash-tiny-fsdp"
    steps = {m["step"]: m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    for step in (1, 2, 3):
        m = steps[step]
        assert m["train/router_agreement"] == 1.0, f"step {step}: R3 must train on the rollout's experts"
        assert {"train/tis_weight_mean", "train/tis_clip_frac", "train/logprob_mismatch"} <= set(m), sorted(m)
        assert m["train/logprob_mismatch"] < 1e-4, (
            "fp32, synchronous: the engine's log-probs are the trainer's"
        )
    assert "eval/held_out/pass@1" in steps[3], "the task's held-out prompts are evaluated"
    assert "eval/aime/pass@1" in steps[3], "the AIME-style evaluation runs at the last step"
    assert (run / "checkpoints" / "step_3").is_dir()
    print(f"tiny run: {time.monotonic() - start:.1f} s")
