"""The embedded engine against hostile and careless requests, over HTTP to a real engine process:
pickles that would run code, requests without the key or with the wrong one, adapters and
checkpoints that would poison what is served, a FIFO in a checkpoint, SIGTERM while a weight
operation is stuck, and a bind beyond loopback without a key."""

from __future__ import annotations

import base64
import io
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from safetensors.torch import load_file, save_file

from miles.engine.process import start_engine
from miles.serving import write_key_file
from miles.weights.tensor import serialize_inline

PROMPT = [12, 40, 7, 99, 5, 230, 61, 18]


class _Run:
    """Pickled, runs `touch MARKER` when loaded by the standard unpickler."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, Path | str]:
    root = tmp_path_factory.mktemp("keys")
    api, admin = root / "api_key", root / "admin_api_key"
    return {"api": write_key_file(api), "admin": write_key_file(admin), "api_file": api, "admin_file": admin}


@pytest.fixture(scope="module")
def engine(tiny_model, keys, tmp_path_factory):
    args = ["--api-key-file", str(keys["api_file"]), "--admin-api-key-file", str(keys["admin_file"])]
    args += [
        "--enable-lora",
        "--max-lora-rank",
        "8",
        "--max-loras-per-batch",
        "2",
        "--lora-target-modules",
        "all",
    ]
    proc = start_engine(tiny_model, device="cpu", dtype="float32", extra_args=args,
                        log_path=tmp_path_factory.mktemp("hostile") / "engine.log")  # fmt: skip
    yield proc
    proc.stop()


def _h(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _logprobs(engine, keys, lora: str | None = None) -> list[float]:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0.0}}
    body |= {"return_logprob": True, "logprob_start_len": 0} | ({"lora_path": lora} if lora else {})
    r = httpx.post(engine.url + "/generate", json=body, headers=_h(keys["api"]), timeout=60)
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    return [row[0] for row in meta["input_token_logprobs"][1:] + meta["output_token_logprobs"]]


def test_a_pickle_posted_to_a_tensor_route_runs_nothing(engine, keys, tmp_path):
    marker = tmp_path / "ran"
    evil = base64.b64encode(pickle.dumps([("model.norm.weight", _Run(marker))])).decode()
    # the inline format's storages are nested torch.save bytes: a pickle hidden there is refused too
    inner = io.BytesIO()
    pickle.dump(_Run(marker), inner)
    nested = base64.b64encode(
        pickle.dumps([("x", (torch.storage._load_from_bytes, (inner.getvalue(),)))])
    ).decode()
    bodies = {
        "/update_weights_from_tensor": lambda p: {"serialized_named_tensors": [p]},
        "/load_lora_adapter_from_tensors": lambda p: {
            "lora_name": "evil",
            "config_dict": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]},
            "serialized_named_tensors": [p],
        },
    }
    for route, body in bodies.items():
        for payload in (evil, nested):
            r = httpx.post(engine.url + route, json=body(payload), headers=_h(keys["admin"]), timeout=60)
            assert r.status_code == 400, (route, r.text)
            assert "refused global" in r.text or "could not be decoded" in r.text, r.text
    assert not marker.exists(), "a request body ran code in the engine"
    assert httpx.get(engine.url + "/health").status_code == 200


def test_keys_follow_sglangs_rules(engine, keys):
    gen = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}
    assert httpx.get(engine.url + "/health").status_code == 200  # probes stay open
    assert httpx.post(engine.url + "/generate", json=gen).status_code == 401
    assert httpx.post(engine.url + "/generate", json=gen, headers=_h("wrong")).status_code == 401
    assert httpx.post(engine.url + "/generate", json=gen, headers=_h(keys["api"])).status_code == 200
    assert httpx.get(engine.url + "/model_info", headers={"x-api-key": keys["api"]}).status_code == 200
    # an admin route takes the admin key only
    assert httpx.post(engine.url + "/flush_cache", headers=_h(keys["api"])).status_code == 401
    assert httpx.post(engine.url + "/flush_cache", headers=_h(keys["admin"])).status_code == 200
    # a real OpenAI client with the key
    client = openai.OpenAI(base_url=engine.url + "/v1", api_key=keys["api"])
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert reply.choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=engine.url + "/v1", api_key="wrong").models.list()


def _peft_adapter(tiny_model: str, out: Path) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], init_lora_weights=False)
    get_peft_model(base, cfg).save_pretrained(out)
    return out


def test_a_poisoned_adapter_is_refused_and_serving_is_unchanged(engine, keys, tiny_model, tmp_path):
    good = _peft_adapter(tiny_model, tmp_path / "good")
    before = _logprobs(engine, keys)
    bad_alpha = tmp_path / "nan_alpha"
    shutil.copytree(good, bad_alpha)
    cfg = json.loads((bad_alpha / "adapter_config.json").read_text())
    (bad_alpha / "adapter_config.json").write_text(json.dumps({**cfg, "lora_alpha": float("nan")}))
    bad_values = tmp_path / "nan_values"
    shutil.copytree(good, bad_values)
    tensors = load_file(str(bad_values / "adapter_model.safetensors"))
    first = sorted(tensors)[0]
    tensors[first] = torch.full_like(tensors[first], float("inf"))
    save_file(tensors, str(bad_values / "adapter_model.safetensors"))
    for path, why in ((bad_alpha, "lora_alpha"), (bad_values, "NaN or infinite")):
        r = httpx.post(engine.url + "/load_lora_adapter", json={"lora_name": "p", "lora_path": str(path)},
                       headers=_h(keys["admin"]), timeout=60)  # fmt: skip
        assert r.status_code == 400 and why in r.json()["error_message"], r.text
    body = {"lora_name": "t", "config_dict": {**cfg, "lora_alpha": 8},
            "serialized_named_tensors": [serialize_inline(list(tensors.items()))]}  # fmt: skip
    r = httpx.post(
        engine.url + "/load_lora_adapter_from_tensors", json=body, headers=_h(keys["admin"]), timeout=60
    )
    assert r.status_code == 400 and "NaN or infinite" in r.json()["error_message"], r.text
    partial = {"lora_name": "t", "config_dict": {**cfg, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
               "serialized_named_tensors": [serialize_inline(list(load_file(str(good / "adapter_model.safetensors")).items()))]}  # fmt: skip
    r = httpx.post(
        engine.url + "/load_lora_adapter_from_tensors", json=partial, headers=_h(keys["admin"]), timeout=60
    )
    assert (
        r.status_code == 400 and "targets ['v_proj'], but it holds no tensors" in r.json()["error_message"]
    ), r.text
    assert _logprobs(engine, keys) == before  # bit-equal: nothing was loaded, no cache was touched


def _checkpoint(tiny_model: str, out: Path, change) -> Path:
    out.mkdir()
    for f in Path(tiny_model).iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, out / f.name)
    tensors = {}
    for f in Path(tiny_model).glob("*.safetensors"):
        tensors.update(load_file(str(f)))
    save_file(change(tensors), str(out / "model.safetensors"))
    return out


def test_a_poisoned_or_partial_checkpoint_is_refused_and_serving_is_unchanged(
    engine, keys, tiny_model, tmp_path
):
    before = _logprobs(engine, keys)
    one = _checkpoint(tiny_model, tmp_path / "one", lambda t: {"model.norm.weight": t["model.norm.weight"]})
    nan = _checkpoint(
        tiny_model, tmp_path / "nan", lambda t: {k: torch.full_like(v, float("nan")) for k, v in t.items()}
    )
    for path, why in ((one, "lacks weights"), (nan, "NaN or infinite")):
        r = httpx.post(engine.url + "/update_weights_from_disk", json={"model_path": str(path)},
                       headers=_h(keys["admin"]), timeout=60)  # fmt: skip
        assert r.status_code == 400 and why in r.json()["message"], r.text
    assert _logprobs(engine, keys) == before
    fifo = _checkpoint(tiny_model, tmp_path / "fifo", lambda t: t)
    (fifo / "model.safetensors").unlink()
    os.mkfifo(fifo / "model.safetensors")
    start = time.monotonic()
    r = httpx.post(engine.url + "/update_weights_from_disk", json={"model_path": str(fifo)},
                   headers=_h(keys["admin"]), timeout=30)  # fmt: skip
    assert r.status_code == 400 and "FIFO" in r.json()["message"], r.text
    assert time.monotonic() - start < 10
    assert httpx.get(engine.url + "/health", timeout=5).status_code == 200
    assert _logprobs(engine, keys) == before


def test_sigterm_ends_the_engine_while_a_weight_operation_is_stuck(tiny_model, tmp_path):
    """A peer that accepts the rendezvous connection and never answers keeps the join waiting (up to
    the engine's weight-update timeout); SIGTERM still ends the engine within its deadline."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    held: list[socket.socket] = []
    threading.Thread(target=lambda: held.append(silent.accept()[0]), daemon=True).start()
    engine = start_engine(tiny_model, device="cpu", log_path=tmp_path / "engine.log")
    try:
        body = {"master_address": "127.0.0.1", "master_port": silent.getsockname()[1], "rank_offset": 1,
                "world_size": 2, "backend": "gloo"}  # fmt: skip
        threading.Thread(
            target=lambda: httpx.post(engine.url + "/init_weights_update_group", json=body, timeout=60),
            daemon=True,
        ).start()
        time.sleep(2.0)
        assert engine.alive()
        start = time.monotonic()
        engine.proc.send_signal(signal.SIGTERM)
        engine.proc.wait(timeout=25)
        assert time.monotonic() - start < 20
    finally:
        engine.stop()
        silent.close()


@pytest.mark.parametrize(
    "module",
    [
        ["miles.engine", "--model", "unused"],
        ["miles.agentic.session_server", "--engine", "x", "--tokenizer", "y"],
    ],
)
def test_a_server_beyond_loopback_without_a_key_refuses_to_start(module):
    out = subprocess.run([sys.executable, "-m", *module, "--host", "0.0.0.0", "--port", "0"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode != 0
    assert "--api-key-file" in out.stderr and "--allow-unauthenticated" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
