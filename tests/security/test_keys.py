"""Keys as SGLang's servers take them: the decision table, key files (mode 600, refused when others
can read them), the run's keys and dry runs that make none, the real sglang-router and the dashboard
behind a key (a browser logs in once with `?key=`)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from miles.engine.process import start_engine
from miles.launch.submit import submit
from miles.rollout.router import start_router
from miles.serving import ApiKeys, key_files, make_run_keys, read_key_file, run_keys, write_key_file

REPO = Path(__file__).resolve().parents[2]


def test_sglangs_decision_table() -> None:
    both, api_only, admin_only, none = ApiKeys("a", "A"), ApiKeys("a"), ApiKeys(None, "A"), ApiKeys()
    bearer = "Bearer {}".format
    assert both.allows("/health", None) and both.allows("/health_generate", None)
    assert both.allows("/generate", bearer("a")) and not both.allows("/generate", bearer("A"))
    assert both.allows("/update_weights_from_disk", bearer("A"))
    assert not both.allows("/update_weights_from_disk", bearer("a"))
    assert api_only.allows("/update_weights_from_disk", bearer("a"))
    assert admin_only.allows("/generate", None) and not admin_only.allows("/load_lora_adapter", None)
    assert none.allows("/update_weights_from_tensor", None)
    assert both.allows("/v1/models", None, x_api_key="a") and not both.allows("/v1/models", "Basic a")
    for variant in ("//update_weights_from_disk", "/update_weights_from_disk/", "/load_lora_adapter//"):
        assert not both.allows(variant, bearer("a")) and both.allows(variant, bearer("A"))
    assert both.headers("/generate") == {"Authorization": "Bearer a"}
    assert both.headers("/update_weights_from_tensor") == {"Authorization": "Bearer A"}


def test_key_files_are_private_and_runs_make_their_own(tmp_path) -> None:
    keys = make_run_keys(tmp_path / "run")
    api, admin = key_files(tmp_path / "run")
    assert (api.stat().st_mode & 0o777, admin.stat().st_mode & 0o777) == (0o600, 0o600)
    assert api.parent.stat().st_mode & 0o777 == 0o700
    assert keys == run_keys(tmp_path / "run") == make_run_keys(tmp_path / "run")  # kept on resume
    assert keys.api != keys.admin and len(keys.api) >= 40
    shared = tmp_path / "shared_key"
    write_key_file(shared)
    shared.chmod(0o644)
    with pytest.raises(ValueError, match="readable by others"):
        read_key_file(shared)


def test_a_dry_run_writes_no_keys(tmp_path) -> None:
    sub = submit(str(REPO / "recipes" / "default.yaml"), "local", [f"run.runs_root={tmp_path}"], dry_run=True)
    assert not key_files(sub.run_dirs[0])[0].exists()


@pytest.fixture(scope="module")
def keyed_engine(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("keyed")
    make_run_keys(root)
    api, admin = key_files(root)
    proc = start_engine(tiny_model, device="cpu", log_path=root / "engine.log",
                        extra_args=["--api-key-file", str(api), "--admin-api-key-file", str(admin)])  # fmt: skip
    yield proc, run_keys(root)
    proc.stop()


def test_the_router_miles_starts_takes_the_runs_key(keyed_engine, tmp_path) -> None:
    engine, keys = keyed_engine
    gen = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
    with start_router([engine.url], api_key=keys.api, log_path=tmp_path / "router.log") as router:
        assert httpx.post(router.url + "/generate", json=gen, timeout=60).status_code == 401
        ok = httpx.post(router.url + "/generate", json=gen, headers=keys.headers("/generate"), timeout=60)
        assert ok.status_code == 200, ok.text
        assert [w["url"] for w in router.workers()] == [engine.url]


def test_the_dashboard_behind_a_key(tmp_path) -> None:
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1, "train/loss": 0.5}\n')
    key_file = tmp_path / "key"
    key = write_key_file(key_file)
    with socket.socket() as s:  # a port for the dashboard (the OS picks it; it is printed too)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "miles.cli", "dashboard", str(run), "--port", str(port),
                             "--api-key-file", str(key_file)], stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                first = httpx.get(url + "/", timeout=5)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.2)
        assert first.status_code == 401
        with httpx.Client(base_url=url, timeout=10, follow_redirects=True) as browser:
            login = browser.get(f"/?key={key}")  # redirected, with the cookie set
            assert login.status_code == 200 and "key=" not in str(login.url)
            assert browser.get("/").status_code == 200
        assert httpx.get(url + "/?key=wrong", timeout=5).status_code == 401
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_the_dashboard_refuses_an_open_bind_beyond_loopback(tmp_path) -> None:
    out = subprocess.run([sys.executable, "-m", "miles.cli", "dashboard", str(tmp_path), "--host", "0.0.0.0"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode != 0 and "--allow-unauthenticated" in out.stdout + out.stderr


def test_a_key_never_reads_as_a_flag(tmp_path, monkeypatch) -> None:
    """One random key in 64 would start with "-", which a command line takes for a flag (sglang-router
    once exited "--api-key: expected one argument"): new keys never do, and the keys Miles passes on a
    command line go as --flag=value."""
    import secrets

    from miles.serving import sglang_key_arguments, write_key_file

    drawn = iter(["-starts-with-a-dash", "fine-key"])
    monkeypatch.setattr(secrets, "token_urlsafe", lambda n: next(drawn))
    assert write_key_file(tmp_path / "keys" / "api_key") == "fine-key"
    (tmp_path / "keys" / "api_key").write_text("-a-users-key\n")
    assert "--api-key=-a-users-key" in sglang_key_arguments(tmp_path)
