"""`miles train` against engines it did not start (`engine.urls`), as a user with SGLang servers of
their own would run it: the test starts embedded engines itself (`python -m miles.engine`, what
`python -m sglang.launch_server` is for SGLang), points a recipe at them and checks that the run
trains through them (metrics, pushed weights equal to the trainer's), that they still serve after
the run, and that a URL which serves nothing, or serves another model, is a clear error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from miles.engine.process import EngineProcess, start_engine
from miles.metrics import read_metrics
from miles.processes import free_port

RECIPE = {
    "run": {"name": "external", "seed": 0, "tensorboard": False},
    "model": {"init_tiny_if_missing": False},
    "rollout": {
        "task": {"name": "digits", "options": {"op": "last", "num_digits": 1}, "eval_size": 5},
        "reward": "miles.rollout.rewards:first_number",
        "prompts_per_step": 4,
        "n_samples_per_prompt": 4,
        "max_new_tokens": 3,
        "max_concurrency_per_engine": 32,
    },
    "eval": {"every_steps": 0},
    "train": {"steps": 3, "lr": 1e-3, "max_tokens_per_microbatch": 512},
    "weights": {"transport": "distributed", "check": True},
}


def _engine(model: str, log: Path, seed: int = 0) -> EngineProcess:
    """An engine started the way a user starts a server: its own process, not Miles' to stop."""
    return start_engine(model, device="cpu", seed=seed, log_path=log, env={"OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def servers(tiny_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("external")
    started: list[EngineProcess] = []
    try:
        for i in range(2):
            started.append(_engine(tiny_model, logs / f"server-{i}.log", seed=i))
        yield started
    finally:
        for e in started:
            e.stop()


def miles_train(tmp_path: Path, model: str, urls: list[str], *sets: str, timeout_s: float = 600):
    """`miles train` on a recipe pointing at `urls`; returns (completed process, run dir)."""
    recipe = {**RECIPE, "run": {**RECIPE["run"], "runs_root": str(tmp_path / "runs")}}
    recipe["model"] = {**recipe["model"], "path": model}
    recipe["engine"] = {"urls": urls}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    cmd = [sys.executable, "-m", "miles.cli", "train", str(path), *(a for s in sets for a in ("--set", s))]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    return proc, tmp_path / "runs" / "external"


def _model_info(server: EngineProcess) -> dict:
    return httpx.get(server.url + "/model_info", timeout=10).json()


def _still_serves(server: EngineProcess) -> None:
    assert server.alive(), f"{server.url} was stopped by a run that did not start it"
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}}
    resp = httpx.post(server.url + "/generate", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["meta_info"]["completion_tokens"] == 2


@pytest.mark.slow
def test_train_through_two_external_engines_leaves_them_serving(servers, tiny_model, tmp_path):
    urls = [s.url for s in servers]
    proc, run_dir = miles_train(tmp_path, tiny_model, urls)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows if "train/loss" in r or "rollout/reward_mean" in r] == [1, 2, 3]
    assert all(r["weights/check_max_diff"] == 0.0 for r in rows if "weights/check_max_diff" in r), rows
    assert len([r for r in rows if "weights/check_max_diff" in r]) == 3
    for s in servers:
        assert _model_info(s)["weight_version"] == "3"  # every step's weights reached both servers
        _still_serves(s)
    records = sorted((run_dir / "rendezvous" / "engines").glob("*.json"))
    published = [json.loads(p.read_text()) for p in records]
    assert [(r["url"], r["node"], r["pid"]) for r in published] == [(u, "external", 0) for u in urls]
    router = json.loads((run_dir / "rendezvous" / "router.json").read_text())  # ours: stopped at the end
    assert not Path(f"/proc/{router['pid']}").exists() or "Z" in _state(router["pid"])
    assert "engine-0.log" not in os.listdir(run_dir / "logs")  # no engine was started


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][:1]


@pytest.mark.slow
def test_disk_transport_reloads_a_server_left_at_another_version(servers, tiny_model, tmp_path):
    server = servers[0]
    resp = httpx.post(server.url + "/update_weight_version", json={"new_version": "41"}, timeout=30)
    assert resp.status_code == 200, resp.text
    proc, run_dir = miles_train(
        tmp_path, tiny_model, [server.url], "weights.transport=disk", "train.steps=2", "rollout.schedule=sync"
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert f"{server.url} serves {tiny_model} (weight version 41); loading model.path" in out
    rows = [r for r in read_metrics(run_dir) if "weights/check_max_diff" in r]
    assert [r["weights/check_max_diff"] for r in rows] == [0.0, 0.0]
    info = _model_info(server)
    assert info["weight_version"] == "2"
    assert Path(info["model_path"]).is_relative_to(run_dir)  # the disk transport's last push
    _still_serves(server)


def _refused(proc: subprocess.CompletedProcess, *phrases: str) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    for phrase in phrases:
        assert phrase in out, out[-3000:]


def test_a_url_that_serves_nothing_is_a_clear_error(tiny_model, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    proc, run_dir = miles_train(tmp_path, tiny_model, [url])
    _refused(proc, f"miles: error: engine.urls: {url} does not answer SGLang's /model_info and /server_info")
    assert not (run_dir / "metrics.jsonl").exists()


def test_impossible_combinations_are_refused_before_anything_runs(tiny_model, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    proc, _ = miles_train(tmp_path, tiny_model, [url], "weights.transport=tensor")
    _refused(proc, "weights.transport=tensor", "engine.urls", "set weights.transport=distributed")
    proc, _ = miles_train(tmp_path, tiny_model, [url], "launch.layout=colocated", "weights.transport=disk")
    _refused(proc, "launch.layout=colocated", "set launch.layout=disaggregated")
    proc, _ = miles_train(tmp_path, tiny_model, ["127.0.0.1:8000"])
    _refused(proc, "engine.urls", "'127.0.0.1:8000' is not a server URL; write http://HOST:PORT")


def test_a_server_of_another_model_is_refused(tiny_model, tmp_path):
    from miles.models.tiny import init_tiny

    other = str(init_tiny(tmp_path / "other-model", seed=0, vocab_size=512))
    server = _engine(other, tmp_path / "other.log")
    try:
        proc, run_dir = miles_train(tmp_path, tiny_model, [server.url])
        _refused(proc, f"engine.urls: {server.url} serves {other} with vocab_size=", "model.path=")
        _still_serves(server)
    finally:
        server.stop()


def test_supervisor_reports_a_failing_external_server_and_never_replaces_it(tmp_path, capsys):
    from miles.config import resolve
    from miles.launch.external import ExternalEngine
    from miles.launch.supervise import EngineSlot, Supervisor

    url = f"http://127.0.0.1:{free_port()}"
    plan = resolve({}, [f'engine.urls=["{url}"]', "engine.health_check_interval_s=0"])
    replaced = []
    slot = EngineSlot(0, ExternalEngine(url, "engine-0"), external=True)
    sup = Supervisor(plan, tmp_path, [slot], restart_engine=replaced.append)
    for _ in range(5):
        sup.check_engines()
    err = capsys.readouterr().err
    assert err.count(f"engine-0 {url} (engine.urls) failed /health 3 times in a row") == 1, err
    assert "does not restart servers it did not start" in err
    assert replaced == [] and slot.restarts == 0
