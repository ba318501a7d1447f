"""The dashboard's JSON endpoints on run directories written by the real metrics logger, and its
refusal of every path outside the run directories (`..`, absolute paths, symbolic links, static files)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient

from miles.cluster.rendezvous import publish_engine
from miles.dashboard.app import create_app, expand_run_dirs
from miles.dashboard.runs import OutsideRunDir, inside
from miles.metrics import MetricsLogger


def make_run(root: Path, name: str, steps: int = 3) -> Path:
    run = root / name
    log = MetricsLogger(run, tensorboard=False)
    for s in range(1, steps + 1):
        log.log(
            s, {"rollout/reward_mean": 0.1 * s, "time/train_s": 1.0, "weights/version": s, "buffer/size": 2}
        )
    log.amend(1, {"eval/pass@1": 0.5})
    log.close()
    plan = {
        "run": {"name": name},
        "train": {"steps": 10, "num_ranks": 2},
        "rollout": {"buffer_capacity_groups": 4},
    }
    (run / "plan.yaml").write_text(yaml.safe_dump(plan))
    (run / "logs").mkdir()
    (run / "logs" / "trainer-0.log").write_text("starting\nstep 3 reward 0.3\n")
    (run / "eval" / "held_out").mkdir(parents=True)
    for step in (0, 2):
        row = {"prompt": f"p{step}", "output": "<b>not html</b>", "score": 1.0, "weight_versions": [step]}
        (run / "eval" / "held_out" / f"step_{step}.jsonl").write_text(json.dumps(row) + "\n")
    publish_engine(run, "engine-0", "http://127.0.0.1:9", 1, "local", "inc-2")  # nothing listens on port 9
    return run


@pytest.fixture
def client(tmp_path):
    runs = tmp_path / "runs"
    make_run(runs, "a")
    make_run(runs, "b", steps=2)
    (tmp_path / "secret.txt").write_text("SECRET-CONTENT")
    (runs / "a" / "escape").symlink_to(tmp_path / "secret.txt")
    return TestClient(create_app(expand_run_dirs([str(runs)])))


def test_runs_metrics_and_versions(client):
    runs = client.get("/api/runs").json()
    assert [r["id"] for r in runs["runs"]] == ["a", "b"]
    assert "rollout/reward_mean" in runs["panels"]["reward"]
    m = client.get("/api/runs/a/metrics").json()
    assert [r["step"] for r in m["records"]] == [1, 2, 3]
    assert m["records"][0]["eval/pass@1"] == 0.5  # amended evaluation reaches the curves
    assert client.get("/api/runs/a/metrics", params={"version": m["version"]}).json()["unchanged"]
    with open(Path(runs["runs"][0]["path"]) / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 4, "time": 0.0, "rollout/reward_mean": 0.9}) + "\n")
    newer = client.get("/api/runs/a/metrics", params={"version": m["version"]}).json()
    assert not newer["unchanged"] and newer["records"][-1] == {
        "step": 4,
        "time": 0.0,
        "rollout/reward_mean": 0.9,
    }


def test_state_and_samples(client):
    s = client.get("/api/runs/a/state").json()
    assert (s["step"], s["steps_planned"], s["weight_version"]) == (3, 10, 3)
    assert s["buffer"] == {"size": 2, "capacity": 4}
    assert s["owner"]["running"] is False
    # a run no process owns: its engines are stopped, not probed as if it were serving
    assert [(e["url"], e["state"]) for e in s["engines"]] == [("http://127.0.0.1:9", "stopped")]
    assert [(t["rank"], t["state"]) for t in s["trainers"]] == [(0, "stopped"), (1, "no log")]
    assert s["trainers"][0]["last_line"] == "step 3 reward 0.3"
    assert s["slurm"] is None  # not submitted: no job.json
    ev = client.get("/api/runs/a/samples").json()["evaluations"]
    assert [(e["dataset"], e["step"]) for e in ev] == [("held_out", 2)]  # the newest evaluation only
    assert ev[0]["rows"][0]["prompt"] == "p2"


def test_submitted_run_without_sacct_shows_the_error(client, tmp_path):
    (tmp_path / "runs" / "b" / "job.json").write_text(json.dumps({"job_id": "1", "log_dir": str(tmp_path)}))
    slurm = client.get("/api/runs/b/state").json()["slurm"]
    assert slurm is not None and ("error" in slurm or slurm["job_id"] == "1")


@pytest.mark.parametrize(
    "path",
    ["../b/plan.yaml", "/etc/passwd", "logs/../../b/plan.yaml", "escape", "..", "", "logs/../../../x"],
)
def test_file_outside_the_run_dir_is_refused(client, path):
    r = client.get("/api/runs/a/file", params={"path": path})
    assert r.status_code in (403, 422), (path, r.status_code)
    assert "SECRET-CONTENT" not in r.text


def test_file_inside_is_served_and_unknown_names_404(client):
    assert client.get("/api/runs/a/file", params={"path": "logs/trainer-0.log"}).text.startswith("starting")
    assert client.get("/api/runs/a/file", params={"path": "logs/none.log"}).status_code == 404
    assert client.get("/api/runs/zz/state").status_code == 404
    assert client.get("/static/app.js").status_code == 200
    for name in ("..%2Fapp.py", "..%2F..%2Fmetrics.py", "%2Fetc%2Fpasswd"):
        assert client.get(f"/static/{name}").status_code == 404
    assert client.post("/api/runs/a/state").status_code == 405  # read-only: no writing verb exists


def test_inside_resolves_links(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "ok").write_text("x")
    assert inside(tmp_path / "run", "ok") == (tmp_path / "run" / "ok").resolve()
    (tmp_path / "secret").write_text("y")
    (tmp_path / "run" / "up").symlink_to(tmp_path)
    assert inside(tmp_path / "run", "up/run/ok") == (tmp_path / "run" / "ok").resolve()  # leads back in
    with pytest.raises(OutsideRunDir):
        inside(tmp_path / "run", "up/secret")


def test_bad_run_dirs_are_named(tmp_path):
    with pytest.raises(ValueError, match="missing"):
        create_app([tmp_path / "missing"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no run directory"):
        expand_run_dirs([str(tmp_path / "empty")])


def test_a_sweep_record_names_its_points(tmp_path):
    a, b = make_run(tmp_path / "runs", "p0"), make_run(tmp_path / "runs", "p1")
    record = tmp_path / "runs" / "sweeps" / "grid.json"
    record.parent.mkdir()
    points = [
        {"run_dir": str(a), "overrides": ["train.lr=1e-3"]},
        {"run_dir": str(b), "overrides": ["train.lr=2e-3"]},
    ]
    record.write_text(json.dumps({"tag": "grid", "points": points}))
    assert expand_run_dirs([str(record)]) == [a, b]
    client = TestClient(create_app(expand_run_dirs([str(record)])))
    assert [r["name"] for r in client.get("/api/runs").json()["runs"]] == ["p0", "p1"]
