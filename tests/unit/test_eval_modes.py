"""Evaluation modes on CPU with real parts: snapshots of the tiny model, external functions in real
child processes, a real eval engine, the metrics logger's records of earlier steps."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from miles.config import ConfigError, resolve
from miles.eval.modes import CountingGenerator, EvalJob, EvalSkipped, Evaluations, evaluate_step
from miles.eval.runner import DedicatedRunner, EvalService, evaluate_snapshot, evaluations
from miles.eval.snapshot import (
    COMPLETE,
    complete_steps,
    export_snapshot,
    find_snapshot,
    prune,
    snapshot_dir,
)
from miles.metrics import MetricsLogger, read_metrics

FNS = Path(__file__).resolve().parents[1] / "e2e"


@pytest.fixture
def fns_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """External functions (tests/e2e/e2e_eval_fns.py) importable here and in child processes."""
    monkeypatch.setenv("PYTHONPATH", str(FNS))
    monkeypatch.syspath_prepend(str(FNS))


def _buckets(model: str) -> list[list]:
    weights = load_file(str(next(Path(model).glob("*.safetensors"))))
    items = sorted(weights.items())
    return [items[: len(items) // 2], items[len(items) // 2 :]]  # two buckets: two safetensors files


def _plan(model: str, **eval_keys):
    return resolve({"model": {"path": model}, "eval": {"every_steps": 1, **eval_keys}})


def _evals(tmp_path: Path, model: str, **eval_keys) -> Evaluations:
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    evals = evaluations(_plan(model, **eval_keys), run_dir)
    assert evals is not None
    return evals


def test_snapshot_is_a_complete_hugging_face_model(tmp_path: Path, tiny_model: str) -> None:
    from transformers import AutoModelForCausalLM

    path = export_snapshot(_buckets(tiny_model), tmp_path, 7, tiny_model)
    assert path == snapshot_dir(tmp_path, 7) and find_snapshot(tmp_path, 7) == path
    marker = json.loads((path / COMPLETE).read_text())
    assert marker["step"] == 7 and marker["bytes"] > 0
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"model-00001.safetensors", "model-00002.safetensors"}
    model = AutoModelForCausalLM.from_pretrained(path)  # config, index, shards: a loadable HF model
    original = load_file(str(next(Path(tiny_model).glob("*.safetensors"))))
    assert all((model.state_dict()[k] == v).all() for k, v in original.items() if k in model.state_dict())
    assert (path / "tokenizer_config.json").exists()


def test_incomplete_snapshot_is_never_used(tmp_path: Path, tiny_model: str) -> None:
    export_snapshot(_buckets(tiny_model), tmp_path, 3, tiny_model)
    path = export_snapshot(_buckets(tiny_model), tmp_path, 5, tiny_model)
    (path / COMPLETE).unlink()  # as if the writer died before the marker
    assert complete_steps(tmp_path) == [3]
    with pytest.raises(FileNotFoundError, match="complete: 3"):
        find_snapshot(tmp_path, 5)


def test_prune_keeps_the_newest_and_those_in_use(tmp_path: Path, tiny_model: str) -> None:
    for step in (1, 2, 3, 4):
        export_snapshot(_buckets(tiny_model), tmp_path, step, tiny_model)
    assert prune(tmp_path, evaluated=[1, 2, 3], in_use={1, 4}, keep=1) == [2]
    assert complete_steps(tmp_path) == [1, 3, 4]
    assert prune(tmp_path, evaluated=[1, 3], in_use=set(), keep=0) == [1, 3]
    assert complete_steps(tmp_path) == [4]


def test_external_results_come_at_their_step_with_lag(tmp_path: Path, tiny_model: str, fns_on_path) -> None:
    evals = _evals(tmp_path, tiny_model, mode="external", external_fn="e2e_eval_fns:quick", max_in_flight=2)
    try:
        for step in (2, 4):
            assert evals.admit(step) == (True, {})
            evals.submit(step, _buckets(tiny_model))
        results = dict(evals.drain(current_step=9))
    finally:
        evals.close()
    assert sorted(results) == [2, 4]
    for step, metrics in results.items():
        assert metrics["eval/snapshot_step"] == step and metrics["eval/custom"] == 1.0
        assert metrics["eval/lag_steps"] == 9 - step
        assert metrics["eval/export_s"] > 0 and metrics["eval/duration_s"] >= 0
        assert "eval/note" not in metrics  # not a number: dropped
    assert complete_steps(evals.run_dir) == [2, 4]  # eval.keep_snapshots=2


@pytest.mark.parametrize(
    "fn, reason",
    [("fails", "error"), ("not_a_dict", "error"), ("crashes", "crash"), ("no_such_fn", "error")],
)
def test_failed_external_eval_is_skipped_and_counted(
    tmp_path: Path, tiny_model: str, fns_on_path, fn: str, reason: str
) -> None:
    evals = _evals(tmp_path, tiny_model, mode="external", external_fn=f"e2e_eval_fns:{fn}", keep_snapshots=0)
    try:
        rows = []
        for step in (1, 2):
            evals.submit(step, _buckets(tiny_model))
            rows += evals.drain(current_step=step)
    finally:
        evals.close()
    assert [step for step, _ in rows] == [1, 2]
    assert [m[f"eval/skipped_{reason}"] for _, m in rows] == [1.0, 2.0]  # counted so far
    assert all("eval/pass@1" not in m and "eval/lag_steps" not in m for _, m in rows)
    assert complete_steps(evals.run_dir) == []  # keep_snapshots=0: deleted once reported


def test_one_failure_does_not_stop_the_next_evaluation(tmp_path: Path, tiny_model: str, fns_on_path) -> None:
    evals = _evals(tmp_path, tiny_model, mode="external", external_fn="e2e_eval_fns:fails_at_odd_steps")
    try:
        for step in (1, 2, 3, 4):
            evals.submit(step, _buckets(tiny_model))
            evals.drain(current_step=step)
        evals.submit(6, _buckets(tiny_model))
        ((step, metrics),) = evals.drain(current_step=6)
    finally:
        evals.close()
    assert step == 6 and metrics["eval/snapshot_step"] == 6 and evals.skipped["error"] == 2


def test_timeout_stops_the_evaluation(tmp_path: Path, tiny_model: str, fns_on_path) -> None:
    evals = _evals(tmp_path, tiny_model, mode="external", external_fn="e2e_eval_fns:slow", timeout_s=0.5)
    try:
        evals.submit(1, _buckets(tiny_model))
        ((_, metrics),) = evals.drain(current_step=1)
    finally:
        evals.close()
    assert metrics["eval/skipped_timeout"] == 1.0 and not evals.runner.procs


def test_overflow_skip_and_wait(tmp_path: Path, tiny_model: str, fns_on_path) -> None:
    evals = _evals(tmp_path, tiny_model, mode="external", external_fn="e2e_eval_fns:slow", overflow="skip")
    try:
        evals.submit(1, _buckets(tiny_model))
        assert evals.admit(2) == (False, {"eval/skipped_overflow": 1.0})
        assert evals.admit(3) == (False, {"eval/skipped_overflow": 2.0})
        assert evals.admit(4, last=True) == (True, {})  # the final weights: waits, training is over
        assert not evals.running
    finally:
        evals.close()
    evals = _evals(tmp_path, tiny_model, mode="external", external_fn="e2e_eval_fns:slow", overflow="wait")
    try:
        evals.submit(5, _buckets(tiny_model))
        assert evals.admit(6) == (True, {})  # returns once step 5's evaluation has finished
        assert not evals.running
        ((step, metrics),) = evals.collect(current_step=6)
    finally:
        evals.close()
    assert step == 5 and metrics["eval/snapshot_step"] == 5 and metrics["eval/lag_steps"] == 1


def test_results_are_reported_in_step_order(tmp_path: Path, tiny_model: str, fns_on_path) -> None:
    fn = "e2e_eval_fns:waits_for_the_next_step"
    evals = _evals(tmp_path, tiny_model, mode="external", external_fn=fn, max_in_flight=2)
    try:
        evals.submit(1, _buckets(tiny_model))
        evals.runner.spec = "e2e_eval_fns:quick"
        evals.submit(2, _buckets(tiny_model))
        while evals.jobs[1].result is None and evals.jobs[1].skipped is None:
            evals._poll()
            time.sleep(0.05)
        assert evals.jobs[1].result is not None  # step 2 finished first (step 1 waited for it)
        reported = evals.collect(current_step=2) + evals.drain(current_step=3)
        assert [s for s, _ in reported] == [1, 2]  # step 2 waited for step 1
    finally:
        evals.close()


def test_dedicated_engine_and_the_mixed_version_check(tmp_path: Path, tiny_model: str) -> None:
    """A dedicated eval engine loads the snapshot as version = step, and every evaluated token is
    checked against it: tokens of another version make the ratio non-zero."""
    plan = _plan(tiny_model, mode="dedicated")
    plan = plan.model_copy(update={"rollout": plan.rollout.model_copy(update={"max_new_tokens": 4})})
    path = export_snapshot(_buckets(tiny_model), tmp_path, 5, tiny_model)
    service = EvalService(plan, tmp_path)
    loop = asyncio.new_event_loop()
    try:
        metrics = loop.run_until_complete(service.evaluate(5, path))
        assert metrics["eval/mixed_version_ratio"] == 0.0 and metrics["eval/weight_version_min"] == 5
        assert metrics["eval/held_out/prompts"] > 0
        assert (tmp_path / "eval" / "held_out" / "step_5.jsonl").exists()  # per-sample records
        gen = service.generator
        assert isinstance(gen, CountingGenerator)
        work = evaluate_step(gen, service.suites, 6, tmp_path / "eval")  # engine still serves step 5
        wrong = loop.run_until_complete(work)
        assert wrong["eval/mixed_version_ratio"] == 1.0
        assert gen.tally.tokens > 0 and gen.tally.other == gen.tally.tokens
        engines = list(service.engines)
    finally:
        loop.run_until_complete(service.close())
        loop.close()
    assert engines and not any(e.alive() for e in engines)


def _finish(runner: DedicatedRunner, job: EvalJob) -> dict[str, float]:
    while (metrics := runner.poll(job)) is None:
        time.sleep(0.1)
    return metrics


def test_dedicated_runner_evaluates_in_a_driver_process_that_is_restarted(
    tmp_path: Path, tiny_model: str
) -> None:
    """The eval driver evaluates each job in a process of its own (its engine a child of it, not of
    this process); a driver killed mid-evaluation fails that one (`crash`), the next starts it again."""
    plan = _plan(tiny_model, mode="dedicated")
    plan = plan.model_copy(update={"rollout": plan.rollout.model_copy(update={"max_new_tokens": 4})})
    paths = {step: export_snapshot(_buckets(tiny_model), tmp_path, step, tiny_model) for step in (1, 2, 3)}
    jobs = {step: EvalJob(step, path, 0.0) for step, path in paths.items()}
    runner = DedicatedRunner(plan, tmp_path)
    try:
        first = runner.proc
        for job in jobs.values():
            job.out_dir.mkdir(parents=True)
        runner.start(jobs[1])
        assert _finish(runner, jobs[1])["eval/weight_version_min"] == 1
        state = json.loads((tmp_path / "logs" / "eval-driver.json").read_text())
        assert state["pid"] == first.pid and len(state["engines"]) == 1
        engine_pid = state["engines"][0]["pid"]
        assert Path(f"/proc/{engine_pid}/stat").read_text().split()[3] == str(first.pid)  # its parent
        os.kill(first.pid, signal.SIGSTOP)  # job 2 stays unread in its pipe: it dies mid-job
        runner.start(jobs[2])
        first.kill()
        with pytest.raises(EvalSkipped, match="crash"):
            _finish(runner, jobs[2])
        runner.start(jobs[3])  # a new driver, a new engine
        assert runner.proc is not first
        assert _finish(runner, jobs[3])["eval/mixed_version_ratio"] == 0.0
        second = runner.proc
    finally:
        runner.stop()
    assert second.poll() is not None and runner.proc is None
    for pid in (
        engine_pid,
        json.loads((tmp_path / "logs" / "eval-driver.json").read_text())["engines"][0]["pid"],
    ):
        deadline = time.monotonic() + 10
        while Path(f"/proc/{pid}").exists() and _state(pid) != "Z" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not Path(f"/proc/{pid}").exists() or _state(pid) == "Z", (
            f"eval engine {pid} outlived its driver"
        )


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def test_by_hand_evaluation_of_a_run_snapshot(tmp_path: Path, tiny_model: str, fns_on_path) -> None:
    from miles.config import write_plan

    write_plan(_plan(tiny_model, mode="external", external_fn="e2e_eval_fns:quick"), tmp_path / "plan.yaml")
    export_snapshot(_buckets(tiny_model), tmp_path, 4, tiny_model)
    assert evaluate_snapshot(tmp_path, 4)["eval/snapshot_step"] == 4
    with pytest.raises(
        FileNotFoundError,
        match="step 3 of .* has neither an eval snapshot nor a checkpoint; steps that can be evaluated: 4",
    ):
        evaluate_snapshot(tmp_path, 3)


def test_metrics_of_an_earlier_step_join_its_record(tmp_path: Path) -> None:
    logger = MetricsLogger(tmp_path, tensorboard=True)
    try:
        for step in (1, 2, 3):
            logger.log(step, {"train/loss": float(step)})
        logger.amend(2, {"eval/pass@1": 0.5, "eval/lag_steps": 1})
        logger.amend(0, {"eval/pass@1": 0.25})  # a step without a record gets one, in order
        logger.log(4, {"train/loss": 4.0})
        with pytest.raises(ValueError, match="after the last step"):
            logger.amend(9, {"eval/pass@1": 1.0})
    finally:
        logger.close()
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert records[2] == {**records[2], "train/loss": 2.0, "eval/pass@1": 0.5, "eval/lag_steps": 1.0}
    assert "amend" not in records[2] and records[2]["time"] < records[0]["time"]  # step 2's own time
    raw = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r.get("amend", False)) for r in raw] == [  # appended, never rewritten
        (1, False),
        (2, False),
        (3, False),
        (2, True),
        (0, True),
        (4, False),
    ]
    assert MetricsLogger(tmp_path, tensorboard=False, resume_step=3).last_step == 3  # a resume folds them
    folded = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert folded == records[:4]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("eval/pass@1")] == [(2, 0.5), (0, 0.25)]
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4]  # nothing purged


def test_eval_mode_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="eval.external_fn"):
        resolve({"eval": {"mode": "external"}})
    with pytest.raises(ConfigError, match="max_in_flight"):
        resolve({"eval": {"mode": "dedicated", "max_in_flight": 0}})
    with pytest.raises(ConfigError, match="eval.overflow"):
        resolve({"eval": {"overflow": "drop"}})
    assert evaluations(resolve({"eval": {"mode": "shared"}}), Path("/nonexistent")) is None


def test_external_fn_that_cannot_be_imported_names_the_key(tmp_path: Path) -> None:
    from miles.eval.runner import load_external

    with pytest.raises(ConfigError, match="eval.external_fn='nope.mod:fn': cannot import"):
        load_external("nope.mod:fn")
    with pytest.raises(ConfigError, match="has no function 'nope'"):
        load_external("json:nope")
    with pytest.raises(ConfigError, match="no module 'nope.mod' on the Python path"):
        _evals(tmp_path, "/nonexistent", mode="external", external_fn="nope.mod:fn")


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "golden"))
from eval_render import CASES, GOLDEN, render  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("case", sorted(CASES))
def test_eval_job_script_matches_golden(case: str) -> None:
    """`miles eval --submit`'s sbatch text; regenerate with tests/golden/eval_render.py."""
    assert render(case) == (GOLDEN / f"{case}.sh").read_text()


def test_miles_eval_submit_dry_run(tmp_path: Path, tiny_model: str) -> None:
    from miles.cli import main
    from miles.config import write_plan

    run_dir = tmp_path / "run"
    write_plan(_plan(tiny_model, mode="dedicated"), run_dir / "plan.yaml")
    assert main(["eval", str(run_dir), "--step", "4", "--submit", "--dry-run"]) == 2  # no snapshot yet
    export_snapshot(_buckets(tiny_model), run_dir, 4, tiny_model)
    assert main(["eval", str(run_dir), "--step", "4", "--submit", "--dry-run"]) == 0
    script = (run_dir / "eval" / "step_4" / "job" / "submission.sh").read_text()
    assert f"miles.eval.runner snapshot --run-dir {run_dir} --step 4" in script
    assert f"RUN_DIR={run_dir}/eval/step_4/job" in script and "#SBATCH --nodes=1" in script
    assert "--requeue" not in script  # an evaluation is not requeued into a training run's directory


def test_deepseek_launcher_eval_job_runs_in_the_profiles_container() -> None:
    """Its snapshots' evaluation as a job of its own: the profile's container, one node of 8 GPUs
    (the launcher's eval settings are checked in tests/unit/test_deepseek_launcher.py)."""
    text = render("deepseek-v4-flash__mi355x__step20")
    assert "--container-image=/shared/containers/miles-rocm.sqsh" in text and "--gpus-per-node=8" in text


def test_snapshot_is_written_off_the_training_thread_from_a_copy(
    tmp_path: Path, tiny_model: str, fns_on_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`submit` returns while the snapshot is still being written (by another thread), the write
    counts as an evaluation in flight, and it writes the weights as they were at submit: training
    changing the tensors in place afterwards does not reach the snapshot."""
    import threading

    import miles.eval.modes as modes

    release, writers = threading.Event(), []

    def slow_export(*args, **kwargs):
        writers.append(threading.current_thread().name)
        assert release.wait(60), "the test never released the write"
        return export_snapshot(*args, **kwargs)

    monkeypatch.setattr(modes, "export_snapshot", slow_export)
    evals = _evals(
        tmp_path,
        tiny_model,
        mode="external",
        external_fn="e2e_eval_fns:quick",
        max_in_flight=1,
        overflow="skip",
    )
    buckets = _buckets(tiny_model)
    name, live = buckets[0][0]
    before = live.clone()
    try:
        evals.submit(3, buckets)
        live.add_(1.0)  # the next training step updates the weights in place
        assert [j.step for j in evals.running] == [3] and not release.is_set()
        assert evals.admit(4) == (False, {"eval/skipped_overflow": 1.0}), "the write is in flight"
        release.set()
        (step, metrics), *_ = evals.drain(current_step=5)
    finally:
        release.set()
        evals.close()
    assert writers and writers[0] != threading.current_thread().name
    assert step == 3 and metrics["eval/snapshot_write_s"] > 0 and metrics["eval/lag_steps"] == 2
    written = {}
    for f in sorted(snapshot_dir(evals.run_dir, 3).glob("*.safetensors")):
        written.update(load_file(str(f)))
    assert torch.equal(written[name], before), "the snapshot must hold the weights of its step"
