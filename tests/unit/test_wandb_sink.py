"""W&B as a second sink of the real MetricsLogger, with the real `wandb` package in offline mode: the
run file under RUN_DIR/wandb holds one history row per step (an amended evaluation at its own step),
the plan as config, the sweep group; a resumed run continues the same W&B run; W&B off leaves no trace."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest

from miles.config import ConfigError
from miles.config.plan import Plan
from miles.config.resolve import write_plan
from miles.metrics import MetricsLogger

wandb = pytest.importorskip("wandb", reason="needs the `wandb` extra (pip install 'miles[wandb]')")

_BLOCK = 32768
_HEADER = 7  # the run file is a LevelDB-style log: 7-byte file header, then 7-byte record headers


def read_records(path: Path) -> list:
    """The protobuf records of a W&B run file (the LevelDB log format wandb documents in its sources)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a W&B run file"
    out, pos, parts = [], _HEADER, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        if length == 0 and kind == 0:
            break
        chunk = data[pos + _HEADER : pos + _HEADER + length]
        parts += chunk
        pos += _HEADER + length
        if kind in (1, 4):  # FULL or LAST fragment
            rec = pb.Record()
            rec.ParseFromString(parts)
            out.append(rec)
            parts = b""
    return out


def run_file(run_dir: Path) -> Path:
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert files, f"no offline W&B run under {run_dir / 'wandb'}"
    return files[-1]


def history(records) -> list[dict]:
    rows = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
    return rows


def enable(run_dir: Path, **wandb_cfg) -> None:
    plan = Plan.model_validate(
        {
            "run": {"name": "wb", "tensorboard": False},
            "launch": {"sweep_tag": "lr-grid"},
            "observe": {"wandb": {"enabled": True, "mode": "offline", "project": "miles-test", **wandb_cfg}},
        }
    )
    write_plan(plan, run_dir / "plan.yaml")


def test_offline_run_holds_rows_config_and_group(tmp_path):
    enable(tmp_path, tags=["unit"])
    log = MetricsLogger(tmp_path, tensorboard=False)
    for step in (1, 2, 3):
        log.log(step, {"rollout/reward_mean": step / 10, "time/train_s": 0.5})
    log.amend(2, {"eval/pass@1": 0.25})  # an evaluation that finished a step later
    log.close()

    records = read_records(run_file(tmp_path))
    rows = history(records)
    assert [(r["step"], r["rollout/reward_mean"]) for r in rows if "rollout/reward_mean" in r] == [
        (1, 0.1),
        (2, 0.2),
        (3, 0.3),
    ]
    assert [(r["step"], r["eval/pass@1"]) for r in rows if "eval/pass@1" in r] == [(2, 0.25)]
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.run_group == "lr-grid" and run.project == "miles-test" and list(run.tags) == ["unit"]
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert config["run"]["name"] == "wb" and config["observe"]["wandb"]["mode"] == "offline"
    plan_updates = [r for r in records if r.WhichOneof("record_type") == "config"]
    assert not any(i.key == "train" for r in plan_updates for i in r.config.update)  # the plan once, at start
    assert (tmp_path / "wandb" / "run_id").read_text().strip() == run.run_id


def test_resume_continues_the_same_wandb_run(tmp_path):
    enable(tmp_path, group="mine")
    log = MetricsLogger(tmp_path, tensorboard=False)
    log.log(1, {"rollout/reward_mean": 0.1})
    log.close()
    first = (tmp_path / "wandb" / "run_id").read_text()
    log = MetricsLogger(tmp_path, tensorboard=False, resume_step=1)
    log.log(2, {"rollout/reward_mean": 0.2})
    log.close()
    assert (tmp_path / "wandb" / "run_id").read_text() == first
    runs = [
        next(r.run for r in read_records(f) if r.WhichOneof("record_type") == "run")
        for f in sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    ]
    assert {r.run_id for r in runs} == {first.strip()} and runs[-1].run_group == "mine"


def test_disabled_or_no_plan_leaves_no_wandb_files(tmp_path):
    log = MetricsLogger(tmp_path / "a", tensorboard=False)  # no plan.yaml at all
    log.log(1, {"x": 1.0})
    log.close()
    write_plan(Plan(), tmp_path / "b" / "plan.yaml")  # observe.wandb.enabled defaults to false
    log = MetricsLogger(tmp_path / "b", tensorboard=False)
    log.log(1, {"x": 1.0})
    log.close()
    assert not (tmp_path / "a" / "wandb").exists() and not (tmp_path / "b" / "wandb").exists()


def test_missing_package_names_the_key_and_the_extra(tmp_path, monkeypatch):
    enable(tmp_path)
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(ConfigError, match=r"observe\.wandb\.enabled.*miles\[wandb\]"):
        MetricsLogger(tmp_path, tensorboard=False)
