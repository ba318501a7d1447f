"""Slurm rendering, pre-submission checks, SGLang command lines and golden sbatch files (no cluster)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from miles.config import ConfigError
from miles.launch.slurm import render_sbatch
from miles.launch.spec import build_job
from miles.launch.submit import grid_points, load_plan, submit, sweep
from miles.rollout.sglang import router_port, sglang_port, sglang_server_command

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "golden"))
from render import golden_path, pairs, render  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "recipes" / "slurm-tiny.yaml")


@pytest.mark.parametrize(("recipe", "profile"), pairs())
def test_golden_sbatch(recipe: str, profile: str) -> None:
    path = golden_path(recipe, profile)
    assert path.exists(), f"missing golden file {path}: run .venv/bin/python tests/golden/render.py"
    assert render(recipe, profile) == path.read_text(), f"{path} differs: review, then regenerate"


def _job(profile: str, overrides: list[str], tmp_path: Path) -> str:
    plan, prof = load_plan(TINY, profile, [f"run.runs_root={tmp_path}", *overrides])
    return render_sbatch(build_job(plan, prof, [plan.run_dir], log_dir=str(tmp_path / "logs")))


def test_het_job_layout_and_requeue_trap(tmp_path: Path) -> None:
    text = _job("local", ["launch.actor_nodes=3"], tmp_path)
    head, _, tail = text.partition("#SBATCH hetjob")
    assert "--nodes=1" in head and "--nodes=3" in tail.split("set -uo")[0]
    assert "--het-group=0" in text and "--het-group=1" in text
    assert "#SBATCH --signal=B:USR2@30" in text and "scontrol requeue" in text
    assert 'touch "$RUN_DIR/control/preempt"' in text and "--resume" in text
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)


def test_cpus_per_task_from_the_recipe(tmp_path: Path) -> None:
    """launch.cpus_per_task sets each trainer rank's CPUs (component and srun line); the default is an
    equal share of the profile's cores; more than a node holds is refused naming the key."""
    default = _job("h200", [], tmp_path)
    actor = default.split("#SBATCH hetjob")[1].split("set -uo")[0]
    assert "--ntasks-per-node=8" in actor and "--cpus-per-task=14" in actor  # 112 cores / 8 ranks
    text = _job("h200", ["launch.cpus_per_task=12"], tmp_path)
    actor = text.split("#SBATCH hetjob")[1].split("set -uo")[0]
    assert "--cpus-per-task=12" in actor
    assert "--het-group=1 --cpus-per-task=12" in text
    with pytest.raises(ConfigError, match="launch.cpus_per_task=15 x 8 trainer ranks"):
        _job("h200", ["launch.cpus_per_task=15"], tmp_path)


STUB_SRUN = """#!/bin/bash
# stands in for srun: the rollout step lives ROLLOUT_S seconds and exits ROLLOUT_RC, the actor likewise;
# SIGTERM ends the step (as srun ends its tasks)
case "$*" in
  *"bootstrap rollout"*) s=$ROLLOUT_S rc=$ROLLOUT_RC ;;
  *"bootstrap eval"*) s=${EVAL_S:-60} rc=${EVAL_RC:-0} ;;
  *) s=$ACTOR_S rc=$ACTOR_RC ;;
esac
trap 'kill "$child"; exit 143' TERM
sleep "$s" & child=$!
wait "$child"
exit "$rc"
"""


@pytest.mark.parametrize(
    ("rollout", "actor", "status", "line"),
    [
        ((0.2, 3), (60, 0), 3, "rollout step exited with 3 before the actor step; stopping the job"),
        ((0.2, 0), (60, 0), 1, "rollout step exited with 0 before the actor step; stopping the job"),
        ((60, 0), (0.2, 7), 7, "actor step exited with 7"),
        ((60, 0), (0.2, 0), 0, "actor step exited with 0"),
    ],
)
def test_batch_script_ends_with_the_first_step_to_end(rollout, actor, status, line, tmp_path: Path) -> None:
    """The rendered script run by bash over a stand-in srun: whichever step ends first ends the job
    (a dead rollout step fails it, the surviving step is stopped), never a hang."""
    plan, prof = load_plan(TINY, "local", [f"run.runs_root={tmp_path}"])
    spec = build_job(plan, prof, [plan.run_dir], log_dir=str(tmp_path / "logs"))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(STUB_SRUN)
    (bin_dir / "srun").chmod(0o755)
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "SLURM_JOB_ID": "7",
        **{"ROLLOUT_S": str(rollout[0]), "ROLLOUT_RC": str(rollout[1])},
        **{"ACTOR_S": str(actor[0]), "ACTOR_RC": str(actor[1])},
    }
    out = subprocess.run(
        ["bash", "-c", render_sbatch(spec)], env=env, capture_output=True, text=True, timeout=30
    )
    assert out.returncode == status and f"miles: {line}" in out.stdout, out


DEDICATED = ["eval.mode=dedicated", "eval.every_steps=2", "launch.actor_nodes=1"]


def _run_script(text: str, tmp_path: Path, **times: str) -> subprocess.CompletedProcess[str]:
    """The batch script run by bash over the stand-in srun, with ROLLOUT_S=..., EVAL_RC=..., etc."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text(STUB_SRUN)
    (bin_dir / "srun").chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "7", **times}
    return subprocess.run(["bash", "-c", text], env=env, capture_output=True, text=True, timeout=30)


def test_dedicated_eval_is_a_third_group(tmp_path: Path) -> None:
    """eval.mode=dedicated: component 2 holds launch.eval_nodes nodes running the eval engines, its step
    starts before the actor step; the node count and the engines per node are checked."""
    text = _job("local", [*DEDICATED, "launch.eval_nodes=2", "eval.num_engines=4"], tmp_path)
    components = text.split("set -uo")[0].split("#SBATCH hetjob")
    assert len(components) == 3 and "--nodes=2" in components[2]
    eval_line = next(line for line in text.splitlines() if "--het-group=2" in line)
    assert (
        "miles.cluster.bootstrap eval --run-dir" in eval_line and '"$RUN_DIR/logs/eval-%t.log"' in eval_line
    )
    assert text.index("EVAL_PID=$!") < text.index("ACTOR_PID=$!")
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)
    plan, prof = load_plan(TINY, "local", [f"run.runs_root={tmp_path}", *DEDICATED, "eval.num_engines=2"])
    from miles.launch.spec import check

    assert check(plan, prof)["eval_engines_per_node"] == 2
    # no group of its own: shared evaluation, evaluation off, or one group for everything
    for other in (["eval.mode=shared"], ["eval.every_steps=0"], ["launch.layout=colocated"]):
        assert "--het-group=2" not in _job("local", [*DEDICATED, *other], tmp_path)
    with pytest.raises(ConfigError, match="eval.num_engines=3 must be a multiple of launch.eval_nodes=2"):
        _job("local", [*DEDICATED, "launch.eval_nodes=2", "eval.num_engines=3"], tmp_path)
    with pytest.raises(ConfigError, match="launch.eval_nodes must be >= 1"):
        _job("local", [*DEDICATED, "launch.eval_nodes=0"], tmp_path)
    with pytest.raises(ConfigError, match="launch.eval_nodes=9"):
        _job("h200", [*DEDICATED, "launch.eval_nodes=9"], tmp_path)  # 11 nodes: the partition's limit
    with pytest.raises(ConfigError, match="2 eval engines per node of engine.tp_size=8 need 16 GPUs"):
        _job("h200", [*DEDICATED, "engine.kind=sglang", "engine.tp_size=8", "eval.num_engines=2"], tmp_path)


@pytest.mark.parametrize(
    ("times", "status", "lines"),
    [
        # the eval step ends first (a lost eval engine): said once, the job goes on and succeeds
        ({"EVAL_S": "0.1", "EVAL_RC": "1", "ACTOR_S": "1", "ACTOR_RC": "0"}, 0,
         ["eval step ended; the job goes on without it", "actor step exited with 0"]),
        # the rollout step still fails the job, the eval step running or not
        ({"ROLLOUT_S": "0.2", "ROLLOUT_RC": "3", "ACTOR_S": "60"}, 3,
         ["rollout step exited with 3 before the actor step; stopping the job"]),
        # the actor's end ends the job and stops the eval step
        ({"ACTOR_S": "0.2", "ACTOR_RC": "0"}, 0, ["actor step exited with 0"]),
    ],
)  # fmt: skip
def test_eval_step_that_ends_does_not_end_the_job(times, status, lines, tmp_path: Path) -> None:
    plan, prof = load_plan(TINY, "local", [f"run.runs_root={tmp_path}", *DEDICATED])
    text = render_sbatch(build_job(plan, prof, [plan.run_dir], log_dir=str(tmp_path / "logs")))
    out = _run_script(text, tmp_path, **{"ROLLOUT_S": "60", "ROLLOUT_RC": "0", **times})
    assert out.returncode == status, out
    assert all(f"miles: {line}" in out.stdout for line in lines), out
    assert out.stdout.count("eval step ended") == (1 if "EVAL_S" in times else 0), out


def test_colocated_is_one_group_with_overlapping_steps(tmp_path: Path) -> None:
    text = _job("local", ["launch.layout=colocated", "launch.requeue=false"], tmp_path)
    assert "hetjob" not in text and "--het-group" not in text
    assert text.count("--overlap") == 2 and "USR2" not in text


def test_profile_env_container_and_segment(tmp_path: Path) -> None:
    text = _job("gb300", [], tmp_path)
    # the profile's 18, sized to each group: 1 rollout node, 2 actor nodes
    assert "#SBATCH --segment=1\n" in text and "#SBATCH --segment=2\n" in text and "--segment=18" not in text
    assert "--container-image=/shared/containers/miles-cuda-arm64.sqsh" in text
    assert 'export TORCH_FR_DUMP_TEMP_FILE="$RUN_DIR/logs/flight_recorder-"' in text
    assert "export NCCL_NVLS_ENABLE=0" in text
    assert "python -m miles.cluster.bootstrap" in text  # the image's python, not this venv's
    plan, _ = load_plan(TINY, "gb300", [])
    assert plan.train.optimizer_offload == "nvme" and plan.engine.kind == "sglang"
    plan, _ = load_plan(TINY, "gb300", ["train.optimizer_offload=cpu"])
    assert plan.train.optimizer_offload == "cpu"  # the recipe / --set beat profile defaults


def test_mpi_bootstrap_profile(tmp_path: Path) -> None:
    prof = tmp_path / "mpi.yaml"
    prof.write_text((REPO / "profiles" / "local.yaml").read_text() + "bootstrap: mpi\n")
    text = _job(str(prof), [], tmp_path)
    actor_line = next(line for line in text.splitlines() if "--het-group=1" in line)
    assert "--mpi=pmix" in actor_line


@pytest.mark.parametrize(
    ("profile", "overrides", "match"),
    [
        ("nope", [], "unknown profile 'nope'; known profiles: b200, gb300"),
        ("local", ["launch.rollot_nodes=2"], "did you mean 'launch.rollout_nodes'"),
        ("local", ["launch.actor_nodes=4"], "needs 5 nodes .* allows 4"),
        ("h200", ["launch.partition=cpu"], "launch.partition='cpu' is not a partition"),
        ("local", ["engine.kind=sglang"], "engine.kind=sglang needs GPUs"),
        ("h200", ["engine.tp_size=3"], "engine.tp_size=3 must divide the 8 GPUs"),
        (
            "h200",
            ["train.backend=megatron", "train.tensor_parallel=3"],
            "not a multiple of train.tensor_parallel",
        ),
        (
            "h200",
            ["train.backend=megatron", "train.pipeline_first_stage_layers=2"],
            "train.pipeline_first_stage_layers sizes a pipeline stage",
        ),
        ("h200", ["launch.actor_tasks_per_node=9"], "exceeds the 8 GPUs per node"),
        ("h200", ["launch.time_limit_min=9999"], "exceeds the 2880 min limit"),
    ],
)
def test_errors_name_what_to_change(profile: str, overrides: list[str], match: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=match):
        _job(profile, overrides, tmp_path)


def test_container_profile_without_image(tmp_path: Path) -> None:
    prof = tmp_path / "noimage.yaml"
    text = (
        (REPO / "profiles" / "h200.yaml").read_text().replace("image: /shared/containers/miles-cuda.sqsh", "")
    )
    prof.write_text(text)
    with pytest.raises(ConfigError, match="names no image; set container.image .* or launch.container_image"):
        _job(str(prof), [], tmp_path)
    assert "miles-x.sqsh" in _job(str(prof), ["launch.container_image=/x/miles-x.sqsh"], tmp_path)


def test_dry_run_writes_script_and_plan(tmp_path: Path) -> None:
    sub = submit(TINY, "local", [f"run.runs_root={tmp_path}"], dry_run=True)
    run_dir = Path(sub.run_dirs[0])
    assert (run_dir / "plan.yaml").is_file() and (run_dir / "launch.json").is_file()
    assert Path(sub.script_path).read_text().startswith("#!/bin/bash")
    assert sub.command == ["sbatch", "--parsable", str(run_dir / "submission.sh")] and not sub.job_ids


def test_cli_dry_run_and_bad_input(tmp_path: Path) -> None:
    miles = [sys.executable, "-m", "miles.cli"]
    ok = subprocess.run(
        [*miles, "submit", TINY, "--profile", "local", "--set", f"run.runs_root={tmp_path}", "--dry-run"],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0, ok.stderr
    assert "sbatch --parsable" in ok.stdout
    bad = subprocess.run(
        [*miles, "submit", TINY, "--profile", "h300", "--dry-run"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "unknown profile 'h300'" in bad.stderr and "Traceback" not in bad.stderr


def test_sweep_dry_run_array_and_het(tmp_path: Path) -> None:
    assert grid_points(["a.b=1,2", "c=x,y"]) == [
        ["a.b=1", "c=x"],
        ["a.b=1", "c=y"],
        ["a.b=2", "c=x"],
        ["a.b=2", "c=y"],
    ]
    with pytest.raises(ConfigError, match="section.key=v1,v2"):
        grid_points(["nonsense"])
    common = [f"run.runs_root={tmp_path}", "launch.array_parallelism=2"]
    arr = sweep(
        TINY, "local", [*common, "launch.layout=colocated"], ["train.lr=0.1,0.2,0.3"], tag="a", dry_run=True
    )
    text = Path(arr.script_path).read_text()
    assert "#SBATCH --array=0-2%2" in text and "hetjob" not in text and len(arr.run_dirs) == 3
    assert 'RUN_DIR="${RUN_DIRS[$SLURM_ARRAY_TASK_ID]}"' in text
    het = sweep(TINY, "local", common, ["train.lr=0.1,0.2"], tag="h", dry_run=True)
    assert len(het.run_dirs) == 2 and "--array" not in Path(het.script_path).read_text()


def test_sglang_command_line() -> None:
    plan, _ = load_plan(
        TINY,
        "mi355x",
        [
            "engine.tp_size=8",
            "engine.ep_size=8",
            "launch.sglang.capture_routed_experts=true",
            "model.path=/m",
        ],
    )
    cmd = sglang_server_command(plan, host="0.0.0.0", port=30000)
    text = " ".join(cmd)
    assert cmd[:3] == ["python", "-m", "sglang.launch_server"]
    for flag in ("--model-path /m", "--tp-size 8", "--ep-size 8", "--mem-fraction-static 0.8"):
        assert flag in text
    assert "--enable-return-routed-experts" in cmd
    ports = {sglang_port(7, i) for i in range(3)} | {router_port(7)}
    assert len(ports) == 4 and sglang_port(8, 0) not in ports


def test_container_recipes_parse() -> None:
    known = {"FROM", "ARG", "ENV", "RUN", "COPY", "WORKDIR"}
    for name in ("Dockerfile.cuda", "Dockerfile.rocm"):
        text = (REPO / "containers" / name).read_text().replace("\\\n", " ")
        words = [line.split()[0] for line in text.splitlines() if line.strip() and not line.startswith("#")]
        assert set(words) <= known and words.count("FROM") == 1, name
        assert all(pin in text for pin in ("megatron-core==", "sglang", "/opt/miles")), name
    for prof in ("h200", "gb300", "mi355x"):
        recipe = load_plan(TINY, prof, [])[1].container.recipe
        assert recipe and (REPO / recipe).is_file()


def test_deepseek_launcher_renders(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(REPO / "launchers" / "deepseek_v4_flash.py"), "train", "--dry-run",
         "--dedicated-eval", "--set", f"run.runs_root={tmp_path}"],
        capture_output=True, text=True, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    facts = (tmp_path / "deepseek-v4-flash" / "launch.json").read_text()
    assert '"actor_ranks": 16' in facts and '"num_engines": 2' in facts
    # --dedicated-eval: a third het group of one node runs the eval engine
    assert '"eval_nodes": 1' in facts and '"eval_engines_per_node": 1' in facts
    text = (tmp_path / "deepseek-v4-flash" / "submission.sh").read_text()
    assert text.count("#SBATCH --gpus-per-node=8") == 3 and "miles-rocm.sqsh" in text
    assert text.count("#SBATCH hetjob") == 2 and "--het-group=2" in text
    assert "miles.cluster.bootstrap eval --run-dir" in text


def test_gpu_placement_of_local_runs() -> None:
    from miles.config import resolve
    from miles.launch.local import gpu_placement

    def plan(layout: str, engines: int = 1, ranks: int = 1):
        sets = [f"launch.layout={layout}", f"engine.num_engines={engines}", f"train.num_ranks={ranks}"]
        return resolve({"weights": {"transport": "tensor"}}, sets)

    assert gpu_placement(plan("disaggregated"), ["0", "1"]) == (["0"], "1")
    assert gpu_placement(plan("disaggregated", 2, 2), ["4", "5", "6", "7"]) == (["4", "5"], "6,7")
    assert gpu_placement(plan("colocated", 2, 2), ["0", "1"]) == (["0", "1"], None)
    assert gpu_placement(plan("colocated"), []) == ([None], None)  # CPU host: nothing to place
    with pytest.raises(ConfigError, match="needs engine.num_engines \\+ train.num_ranks = 3 GPUs"):
        gpu_placement(plan("disaggregated", 1, 2), ["0", "1"])


def test_bad_task_or_reward_is_a_config_error_before_anything_starts() -> None:
    from miles.config import resolve
    from miles.loop.inputs import check_inputs

    check_inputs(resolve({}))
    too_many = {"rollout": {"task": {"name": "digits", "options": {"num_digits": 1}, "eval_size": 50}}}
    with pytest.raises(ConfigError, match="eval_size"):
        check_inputs(resolve(too_many))
    with pytest.raises(ConfigError, match="has no function 'nope'"):
        check_inputs(resolve({"rollout": {"reward": "miles.rollout.rewards:nope"}}))


def test_failure_names_the_role_its_error_and_log(tmp_path: Path) -> None:
    from miles.launch.status import failure, format_failure

    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "actor-0.log").write_text("slurmstepd: error: *** STEP 5.1 ON n2 CANCELLED ***\n")
    (logs / "actor-1.log").write_text(
        "step 1\nTraceback (most recent call last):\n  File 'x.py', line 1\nRuntimeError: Timed out\n"
    )
    (logs / "rollout-0.log").write_text("miles bootstrap: engine 0 (pid 9) exited with -9; see engine.log\n")
    fail = failure(tmp_path, "miles: job 5 start 0\nmiles: actor step exited with 1\n")
    assert fail == {
        "role": "actor",
        "exit_code": 1,
        "log": str(logs / "actor-1.log"),
        "error": "Traceback (most recent call last):\n  File 'x.py', line 1\nRuntimeError: Timed out",
    }
    assert "the actor step failed (exit 1)" in format_failure(tmp_path, fail)
    early = failure(tmp_path, "miles: rollout step exited with 0 before the actor step; stopping the job\n")
    assert (
        early and (early["role"], early["exit_code"]) == ("rollout", 1) and "exited with -9" in early["error"]
    )
    assert failure(tmp_path, "miles: actor step exited with 0\n") is None


def test_a_dry_run_leaves_an_earlier_runs_files_alone(tmp_path: Path) -> None:
    run_dir = tmp_path / "slurm-tiny"
    (run_dir / "checkpoints" / "step_2").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    (run_dir / "plan.yaml").write_text("the plan that ran\n")
    sub = submit(TINY, "h200", [f"run.runs_root={tmp_path}"], dry_run=True)
    assert (run_dir / "plan.yaml").read_text() == "the plan that ran\n"
    assert not (run_dir / "submission.sh").exists() and not (run_dir / "launch.json").exists()
    beside = tmp_path / "slurm-tiny.dry-run"
    assert Path(sub.script_path) == beside / "submission.sh" and (beside / "plan.yaml").is_file()
    assert f"RUN_DIR={run_dir}" in Path(sub.script_path).read_text()  # what a submit would run


def test_a_dry_run_sweep_of_het_jobs_prints_every_points_sbatch_line(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "miles.cli", "sweep", TINY, "--profile", "local", "--set",
         f"run.runs_root={tmp_path}", "--grid", "train.lr=0.1,0.2,0.3", "--tag", "t", "--dry-run"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = [x for x in out.stdout.splitlines() if x.startswith("sbatch")]
    assert len(lines) == 3 and len(set(lines)) == 3, out.stdout


def test_a_segment_size_divides_each_het_components_node_count(tmp_path: Path) -> None:
    """GB300's --segment=18 (topology/block): every het component gets a segment Slurm accepts (its
    node count must be a multiple of the segment size)."""
    from miles.launch.spec import sized_flags

    text = _job("gb300", ["launch.rollout_nodes=2", "launch.actor_nodes=3"], tmp_path)
    nodes = [int(x.split("=")[1]) for x in text.splitlines() if x.startswith("#SBATCH --nodes=")]
    segments = [int(x.split("=")[1]) for x in text.splitlines() if x.startswith("#SBATCH --segment=")]
    assert nodes == [2, 3] and segments == [2, 3]
    assert sized_flags(("--segment=18",), 36) == ("--segment=18",)
    assert sized_flags(("--segment=18", "--exclusive"), 20) == ("--segment=10", "--exclusive")
