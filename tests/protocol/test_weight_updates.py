"""SGLang's weight-update protocol against the real engine process: an upstream-style trainer in a
second process joins the update group and broadcasts new weights; a trainer that never shows up, or
never broadcasts, gets a bounded `{"success": false}` 400 while /generate goes on; every failure and
malformed field answers as SGLang does; the engine serves after all of it.

The engine runs with a short `--weight-update-timeout-s` so the failure cases finish in seconds;
the HTTP clients here wait a little longer than the engine's bound, so a call that blocked past it
would fail the test.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from upstream_trainer import new_weights

from miles.engine.process import start_engine
from miles.engine.updates import GRACE_S
from miles.processes import free_port
from miles.rollout.client import SGLangClient
from miles.weights.group import broadcast_from_trainer, destroy_update_group, init_update_group

TIMEOUT_S = 4.0
BOUND_S = TIMEOUT_S + GRACE_S + 10.0
"""How long a client here waits for any weight call: past the engine's own bound, with a margin."""
TRAINER = Path(__file__).with_name("upstream_trainer.py")
PROMPT = [12, 13, 14, 15]


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    proc = start_engine(
        tiny_model,
        device="cpu",
        log_path=tmp_path_factory.mktemp("protocol-weights") / "engine.log",
        extra_args=["--weight-update-timeout-s", str(TIMEOUT_S)],
    )
    yield proc
    proc.stop()


def _post(engine, route: str, body, timeout: float = BOUND_S) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(engine.url + route, content=body, timeout=timeout)
    return httpx.post(engine.url + route, json=body, timeout=timeout)


def _generate(engine) -> dict:
    resp = _post(engine, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4}}, 60)
    assert resp.status_code == 200, resp.text
    assert len(resp.json()["output_ids"]) == 4
    return resp.json()


def _weight(engine, name: str) -> torch.Tensor:
    resp = _post(engine, "/get_weights_by_name", {"name": name, "truncate_size": 1 << 20})
    assert resp.status_code == 200, resp.text
    return torch.tensor(resp.json())


def _failed(resp: httpx.Response, *extra: str) -> str:
    """The message of SGLang's failure answer; fails the test on any other answer."""
    assert resp.status_code == 400, resp.text
    body = resp.json()
    assert body["success"] is False and set(body) == {"success", "message", *extra}, body
    return body["message"]


def _group(port: int, name: str) -> dict:
    return {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": name,
        "backend": "gloo",
    }


def test_upstream_trainer_joins_and_broadcasts(engine, tiny_model):
    run = subprocess.run(
        [sys.executable, str(TRAINER), "--url", engine.url, "--model", tiny_model]
        + ["--seed", "11", "--version", "upstream-11", "--group-name", "miles-pp_0"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    replies = {r["route"]: r["reply"] for r in map(json.loads, run.stdout.splitlines()) if "route" in r}
    assert replies["/init_weights_update_group"] == {
        "success": True,
        "message": "Succeeded to initialize custom process group.",
    }
    assert replies["/update_weight_version"]["new_version"] == "upstream-11"
    expected = new_weights(tiny_model, 11)
    assert all(torch.equal(_weight(engine, name), t) for name, t in expected.items())
    assert _generate(engine)["meta_info"]["weight_version"] == "upstream-11"
    assert asyncio.run(SGLangClient(engine.url).get_weight_version()) == "upstream-11"
    assert "does not exist" in _failed(
        _post(engine, "/destroy_weights_update_group", {"group_name": "miles-pp_0"})
    )


def test_trainer_that_never_joins_gets_a_bounded_failure(engine):
    """Nobody hosts the store: the join fails within the engine's bound; /generate is served meanwhile."""
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(_post, engine, "/init_weights_update_group", _group(free_port(), "nobody"))
        during = _generate(engine)
        message = _failed(pending.result())
    assert message.startswith("Failed to initialize custom process group") and during["output_ids"]
    assert "does not exist" in _failed(
        _post(engine, "/destroy_weights_update_group", {"group_name": "nobody"})
    )
    _generate(engine)


def test_own_trainer_side_and_a_broadcast_that_never_comes(engine, tiny_model):
    """This process is rank 0 through miles.weights.group: one real update, then an update whose
    tensors are never sent fails within the bound, the engine drops the group and goes on serving."""
    port, name = free_port(), "own-group"
    with ThreadPoolExecutor(1) as pool:
        joining = pool.submit(_post, engine, "/init_weights_update_group", _group(port, name))
        group = init_update_group("127.0.0.1", port, 0, 2, name, "gloo", timeout_s=60)
        assert joining.result().json()["success"] is True
        try:
            norm = torch.full_like(_weight(engine, "model.norm.weight"), 0.5)
            body = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [list(norm.shape)]}
            update = pool.submit(
                _post, engine, "/update_weights_from_distributed", {**body, "group_name": name}
            )
            broadcast_from_trainer(norm, group)
            assert update.result().json()["success"] is True
            assert torch.equal(_weight(engine, "model.norm.weight"), norm)
            silent = pool.submit(
                _post, engine, "/update_weights_from_distributed", {**body, "group_name": name}
            )
            _generate(engine)
            assert "was dropped" in _failed(silent.result())
        finally:
            destroy_update_group(group)
    assert "does not exist" in _failed(_post(engine, "/destroy_weights_update_group", {"group_name": name}))
    _generate(engine)


def test_failures_answer_success_false(engine):
    dist = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[8]], "group_name": "none"}
    disk = _failed(
        _post(engine, "/update_weights_from_disk", {"model_path": "/no/dir"}), "num_paused_requests"
    )
    assert "not a directory" in disk
    cases = [
        ("/destroy_weights_update_group", {"group_name": "never-made"}, "does not exist"),
        ("/update_weights_from_distributed", dist, "/init_weights_update_group"),
        ("/init_weights_update_group", {**_group(free_port(), "n"), "backend": "nccl"}, "gloo"),
        ("/update_weights_from_tensor", {"serialized_named_tensors": ["bm90IGEgcGlja2xl"]}, "decoded"),
    ]
    for route, body, words in cases:
        assert words in _failed(_post(engine, route, body)), route
    _generate(engine)


def test_session_and_version_routes(engine):
    ok = {"success": True, "message": "Success"}
    assert _post(engine, "/begin_weight_update", {}).json() == ok
    assert "already open" in _failed(_post(engine, "/begin_weight_update", {"selector": "target"}))
    assert _post(engine, "/end_weight_update", {}).json() == ok
    assert "no weight-update session" in _failed(_post(engine, "/end_weight_update", {}))
    reply = _post(engine, "/update_weight_version", {"new_version": "manual-7"})
    assert reply.json() == {
        "success": True,
        "message": "Weight version updated to manual-7",
        "new_version": "manual-7",
    }
    assert _generate(engine)["meta_info"]["weight_version"] == "manual-7"
    assert asyncio.run(SGLangClient(engine.url).get_weight_version()) == "manual-7"


def test_model_path_follows_disk_update(engine, tiny_model, tmp_path):
    target = shutil.copytree(tiny_model, tmp_path / "next-checkpoint")
    reply = _post(
        engine, "/update_weights_from_disk", {"model_path": str(target), "weight_version": "disk-1"}
    )
    assert reply.json() == {
        "success": True,
        "message": "Succeeded to update model weights.",
        "num_paused_requests": 0,
    }
    info = httpx.get(engine.url + "/get_model_info", timeout=30).json()
    assert info["model_path"] == str(target) and info["weight_version"] == "disk-1"


INIT = _group(1234, "bad")
DIST = {"names": ["a"], "dtypes": ["float32"], "shapes": [[2]]}
BATTERY = [
    (
        "/init_weights_update_group",
        {k: v for k, v in INIT.items() if k != "master_address"},
        "master_address",
    ),
    ("/init_weights_update_group", {**INIT, "master_address": ""}, "master_address"),
    ("/init_weights_update_group", {**INIT, "master_port": "http"}, "master_port"),
    ("/init_weights_update_group", {**INIT, "master_port": 70000}, "master_port"),
    ("/init_weights_update_group", {**INIT, "rank_offset": 0}, "rank_offset"),
    ("/init_weights_update_group", {**INIT, "rank_offset": 2}, "rank_offset"),
    ("/init_weights_update_group", {**INIT, "world_size": 1.5}, "world_size"),
    ("/init_weights_update_group", {**INIT, "backend": "mpi"}, "backend"),
    ("/init_weights_update_group", {**INIT, "group_name": ""}, "group_name"),
    ("/init_weights_update_group", {**INIT, "master_addr": "x"}, "master_addr"),
    ("/update_weights_from_distributed", {**DIST, "names": []}, "same length"),
    ("/update_weights_from_distributed", {**DIST, "dtypes": ["float99"]}, "dtypes"),
    ("/update_weights_from_distributed", {**DIST, "shapes": [[-2]]}, "shapes"),
    ("/update_weights_from_distributed", {**DIST, "load_format": "zip"}, "load_format"),
    ("/update_weights_from_distributed", {**DIST, "selector": "draft"}, "selector"),
    ("/update_weights_from_distributed", {**DIST, "flush_cache": "maybe"}, "flush_cache"),
    ("/update_weights_from_distributed", {**DIST, "weight_version": 3}, "weight_version"),
    ("/update_weights_from_distributed", {"dtypes": ["float32"], "shapes": [[2]]}, "names"),
    ("/update_weights_from_disk", {}, "model_path"),
    ("/update_weights_from_disk", {"model_path": "/x", "is_async": True}, "is_async"),
    ("/update_weights_from_disk", {"model_path": "/x", "load_format": "gguf"}, "load_format"),
    ("/update_weights_from_tensor", {"serialized_named_tensors": "abc"}, "serialized_named_tensors"),
    ("/update_weights_from_tensor", {"serialized_named_tensors": ["a", "b"]}, "serialized_named_tensors"),
    ("/update_weight_version", {}, "new_version"),
    ("/update_weight_version", {"new_version": 3}, "new_version"),
    ("/update_weight_version", {"new_version": "v", "abort_all_requests": "no"}, "abort_all_requests"),
    ("/begin_weight_update", {"selector": "draft"}, "selector"),
    ("/end_weight_update", {"selector": "all"}, "selector"),
    ("/destroy_weights_update_group", {"group_name": 5}, "group_name"),
    ("/update_weights_from_distributed", b"{not json", "JSON"),
    ("/init_weights_update_group", b"[1, 2]", "JSON object"),
]


def test_bad_input_battery_names_each_field_then_engine_serves(engine):
    wrong = []
    for route, body, field in BATTERY:
        resp = _post(engine, route, body)
        if (
            resp.status_code != 400
            or resp.json().get("success") is not False
            or field not in resp.json()["message"]
        ):
            wrong.append((route, body, resp.status_code, resp.text))
    assert wrong == []
    bad_read = _post(engine, "/get_weights_by_name", {"name": "no.such.weight"})
    assert bad_read.status_code == 400 and "no.such.weight" in bad_read.text
    _generate(engine)
    assert engine.alive()
