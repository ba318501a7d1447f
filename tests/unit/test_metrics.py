"""metrics.jsonl: durable appends, cut back on resume, torn lines skipped; plots are written."""

from __future__ import annotations

import json

import pytest

from miles.metrics import MetricsLogger, plot_run, read_metrics


def test_append_and_resume_truncates(tmp_path) -> None:
    log = MetricsLogger(tmp_path, tensorboard=False)
    for step in range(5):
        log.log(step, {"rollout/reward_mean": step / 10, "not_a_number": "x"})
    log.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2, 3, 4]
    assert "not_a_number" not in read_metrics(tmp_path)[0]
    log = MetricsLogger(tmp_path, tensorboard=False, resume_step=2)
    log.log(3, {"rollout/reward_mean": 0.9})
    log.close()
    steps = [r["step"] for r in read_metrics(tmp_path)]
    assert steps == [0, 1, 2, 3]
    assert read_metrics(tmp_path)[-1]["rollout/reward_mean"] == 0.9


def test_fresh_start_clears_old_records(tmp_path) -> None:
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 7}) + "\n")
    MetricsLogger(tmp_path, tensorboard=False).close()
    assert read_metrics(tmp_path) == []


def test_torn_last_line_is_skipped(tmp_path) -> None:
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n" + '{"step": 2, "rol')
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]


def test_tensorboard_events_written(tmp_path) -> None:
    log = MetricsLogger(tmp_path, tensorboard=True)
    log.log(1, {"rollout/reward_mean": 0.5})
    log.close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_plot_run_writes_pngs(tmp_path) -> None:
    log = MetricsLogger(tmp_path, tensorboard=False)
    log.log(0, {"eval/pass@1": 0.0, "eval/pass@k": 0.1})
    for step in range(1, 4):
        log.log(step, {"rollout/reward_mean": step / 4, "time/train_s": 0.1, "time/rollout_s": 0.2})
    log.close()
    paths = plot_run(tmp_path)
    names = sorted(p.rsplit("/", 1)[-1] for p in paths)
    assert names == ["eval.png", "reward.png", "summary.png", "time.png"]
    assert all(open(p, "rb").read(4) == b"\x89PNG" for p in paths)


def test_plot_run_without_metrics_is_clear(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        plot_run(tmp_path)


def test_miles_plot_ends_with_one_summary_line(tmp_path) -> None:
    """`miles plot RUN` (the last command of `make run`) ends with the run's held-out pass@1 before
    and after, its steps and wall time, and where the plots are."""
    import subprocess
    import sys

    log = MetricsLogger(tmp_path, tensorboard=False)
    log.log(0, {"eval/pass@1": 0.125})
    log.log(1, {"rollout/reward_mean": 0.5})
    log.log(2, {"eval/pass@1": 0.75})
    log.close()
    out = subprocess.run(
        [sys.executable, "-m", "miles", "plot", str(tmp_path)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith(
        f"miles: {tmp_path}: held-out eval/pass@1 0.125 (step 0) -> 0.750 (step 2); 2 steps in "
    )
    assert last.endswith(f"min; plots in {tmp_path / 'plots'}")


def test_the_summary_names_the_tasks_held_out_figure_beside_other_datasets() -> None:
    """With further evaluation datasets, `eval/pass@1` is their mean: the summary line reports the
    task's held-out prompts (`eval/held_out/pass@1`)."""
    from miles.metrics import eval_progress

    both = [
        {"step": 0, "eval/pass@1": 0.0, "eval/held_out/pass@1": 0.0, "eval/aime/pass@1": 0.0},
        {"step": 300, "eval/pass@1": 0.422, "eval/held_out/pass@1": 0.844, "eval/aime/pass@1": 0.0},
    ]
    assert eval_progress(both) == "held-out eval/pass@1 0.000 (step 0) -> 0.844 (step 300)"
    alone = [{"step": 0, "eval/pass@1": 0.125}, {"step": 2, "eval/pass@1": 0.75}]
    assert eval_progress(alone) == "held-out eval/pass@1 0.125 (step 0) -> 0.750 (step 2)"
