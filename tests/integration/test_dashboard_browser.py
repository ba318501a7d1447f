"""The dashboard in a real browser: headless Chromium (Debian package `chromium`) opens `miles dashboard`
on a run that `miles train` made on the CPU, waits for the curves to draw, checks the page, saves a
screenshot (the test's tmp dir and RUN_DIR/plots/dashboard.png), sees a new metrics row appear, and
the live server refuses paths outside the run directory."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="needs headless Chromium (Debian package `chromium`)"
)
pytestmark = pytest.mark.slow

RECIPE = {
    "run": {"name": "dash", "seed": 0, "tensorboard": False},
    "model": {"init_tiny_if_missing": False},
    "engine": {"max_running_requests": 32},
    "rollout": {
        "task": {"name": "digits", "options": {"op": "last", "num_digits": 1}, "eval_size": 4},
        "reward": "miles.rollout.rewards:first_number",
        "prompts_per_step": 2,
        "n_samples_per_prompt": 4,
        "max_new_tokens": 3,
    },
    "eval": {"every_steps": 1},
    "train": {"steps": 2, "lr": 1e-3, "max_tokens_per_microbatch": 512},
}


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, tiny_model) -> Path:
    """A 2-step CPU run of `miles train` (evaluations at steps 0..2 write per-sample records)."""
    root = tmp_path_factory.mktemp("dash")
    recipe = {**RECIPE, "model": {**RECIPE["model"], "path": tiny_model}}
    recipe["run"] = {**RECIPE["run"], "runs_root": str(root / "runs")}
    (root / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    cmd = [sys.executable, "-m", "miles.cli", "train", str(root / "recipe.yaml")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=500)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    return root / "runs" / "dash"


@pytest.fixture
def dashboard(trained_run):
    """`miles dashboard RUN_DIR` on a port the OS picks; yields its URL."""
    cmd = [sys.executable, "-m", "miles.cli", "dashboard", str(trained_run)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        m = re.search(r"http://127\.0\.0\.1:\d+/", line)
        assert m, f"no URL in the dashboard's first line: {line!r}"
        yield m.group(0)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def chromium(url: str, *args: str, budget_ms: int = 6000) -> str:
    """Headless Chromium on `url` after `budget_ms` of virtual time (timers and polls run); its stdout."""
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",  # tests may run as root in a container
        "--disable-gpu",
        "--no-first-run",
        f"--virtual-time-budget={budget_ms}",
        "--window-size=1400,2000",
        *args,
        url,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def chart_attrs(dom: str, panel: str) -> dict[str, str]:
    m = re.search(rf'<div class="chart" data-panel="{re.escape(panel)}"([^>]*)>', dom)
    assert m, f"no {panel!r} chart in the page"
    return dict(re.findall(r'data-([\w-]+)="([^"]*)"', m.group(1)))


@needs_chromium
def test_page_draws_the_run_and_updates(dashboard, trained_run, tmp_path):
    dom = chromium(dashboard, "--dump-dom")
    reward = chart_attrs(dom, "reward")
    assert reward["drawn"] == "1" and reward["last-step"] == "2", reward
    assert chart_attrs(dom, "step time (s)")["drawn"] == "1"
    assert chart_attrs(dom, "eval")["points"] == "3"  # evaluations of steps 0, 1 and 2
    assert "<canvas" in dom  # uPlot drew into canvases
    assert "step 2 / 2" in dom and "trainer ranks (1)" in dom and "engines (1)" in dom
    assert re.search(r"held_out at step 2", dom), "the newest evaluation's samples are shown"

    shot = tmp_path / "dashboard.png"
    chromium(dashboard, f"--screenshot={shot}")
    assert shot.stat().st_size > 10_000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (trained_run / "plots").mkdir(exist_ok=True)
    shutil.copy(shot, trained_run / "plots" / "dashboard.png")

    api = f"{dashboard}api/runs/dash/metrics"
    version = httpx.get(api).json()["version"]
    with open(trained_run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 3, "time": 0.0, "rollout/reward_mean": 0.75, "time/train_s": 1.0}) + "\n")
    changed = httpx.get(api, params={"version": version}).json()
    assert not changed["unchanged"] and changed["records"][-1]["step"] == 3
    after = chromium(dashboard, "--dump-dom")
    assert chart_attrs(after, "reward")["last-step"] == "3"


@needs_chromium
def test_live_server_refuses_paths_outside(dashboard, trained_run):
    base = f"{dashboard}api/runs/dash/file"
    assert httpx.get(base, params={"path": "plan.yaml"}).status_code == 200
    for path in ("../../../../etc/passwd", "/etc/passwd", "logs/../../dash/../../x"):
        assert httpx.get(base, params={"path": path}).status_code == 403, path
    raw = f"{dashboard}static/%2e%2e%2fapp.py"  # encoded so that no client folds the dots away
    assert httpx.get(raw).status_code == 404


def _slurm_down() -> str | None:
    if shutil.which("sinfo") is None:
        return "Slurm is not installed"
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True)
    idle = [x for x in out.stdout.split() if x in ("idle", "mixed", "allocated")]
    return None if out.returncode == 0 and len(idle) >= 3 else "dev cluster not up (make slurm-up)"


@pytest.mark.slurm
@pytest.mark.skipif(_slurm_down() is not None, reason=_slurm_down() or "")
def test_submitted_run_shows_its_job_and_components(tmp_path, tiny_model):
    """A het job on the dev cluster: the run's card names the job, its state and both components."""
    import time

    from miles.cluster.rendezvous import read_engines
    from miles.dashboard.runs import RunView
    from miles.launch.status import cancel, run_logs
    from miles.launch.submit import submit

    recipe = str(Path(__file__).resolve().parents[2] / "recipes" / "slurm-tiny.yaml")
    overrides = [f"run.runs_root={tmp_path}", f"model.path={tiny_model}", "train.steps=200"]
    sub = submit(recipe, "local", [*overrides, "launch.actor_module=miles.cluster.selftest"])
    run_dir, job = Path(sub.run_dirs[0]), sub.job_ids[0]
    try:
        deadline = time.monotonic() + 120
        while not read_engines(run_dir, f"{job}.0"):
            assert time.monotonic() < deadline, run_logs(run_dir, "rollout")
            time.sleep(0.5)
        while True:  # sacct (slurmdbd) learns of the start a moment after the job runs
            state = RunView("r", run_dir).state()
            slurm = state["slurm"]
            if slurm.get("state", "").startswith("RUNNING") and len(slurm["components"]) == 2:
                break
            assert time.monotonic() < deadline, slurm
            time.sleep(1)
        assert slurm["job_id"] == job, slurm
        assert [c["id"] for c in slurm["components"]] == [f"{job}+0", f"{job}+1"], slurm
        assert all(c["state"].startswith("RUNNING") for c in slurm["components"]), slurm
        assert [e["state"] for e in state["engines"]] == ["serving"]
    finally:
        cancel(run_dir)
