"""The engine process under bad input and injected faults: every field range-checked, bodies size-limited,
a failing step fails only its batch, a dead or stuck engine thread makes /health and /generate answer
503 instead of hanging, and SIGTERM stops the process whatever state its engine thread is in."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from miles.engine.process import EngineProcess, start_engine

GOOD = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3, "temperature": 0}}


def _start(tiny_model, tmp_path, *args: str) -> EngineProcess:
    return start_engine(
        tiny_model,
        device="cpu",
        max_total_tokens=4096,
        log_path=tmp_path / "engine.log",
        extra_args=["--enable-fault-injection", *args],
    )


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    proc = _start(tiny_model, tmp_path_factory.mktemp("faults"))
    yield proc
    proc.stop()


def _generate(engine: EngineProcess, body=GOOD, timeout: float = 60) -> httpx.Response:
    return httpx.post(engine.url + "/generate", json=body, timeout=timeout)


def _serves(engine: EngineProcess) -> None:
    resp = _generate(engine)
    assert resp.status_code == 200, resp.text
    assert resp.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert httpx.get(engine.url + "/health", timeout=10).status_code == 200


def _inject(engine: EngineProcess, kind: str, **extra) -> None:
    resp = httpx.post(engine.url + "/debug/inject_fault", json={"kind": kind, **extra}, timeout=30)
    assert resp.status_code == 200, resp.text


def _wait_unhealthy(engine: EngineProcess, limit_s: float = 30) -> str:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        resp = httpx.get(engine.url + "/health", timeout=10)
        if resp.status_code == 503:
            return resp.json()["error"]["message"]
        time.sleep(0.05)
    raise AssertionError(f"/health stayed 200 for {limit_s} s")


BIG = 2**80
BAD_FIELDS = [
    ({"sampling_seed": BIG}, "sampling_params.sampling_seed"),
    ({"sampling_seed": -(2**63) - 1}, "sampling_params.sampling_seed"),
    ({"temperature": -1}, "sampling_params.temperature"),
    ({"top_p": 0}, "sampling_params.top_p"),
    ({"top_p": 1.5}, "sampling_params.top_p"),
    ({"top_k": 0}, "sampling_params.top_k"),
    ({"top_k": BIG}, "sampling_params.top_k"),
    ({"max_new_tokens": -1}, "sampling_params.max_new_tokens"),
    ({"max_new_tokens": 2**63}, "sampling_params.max_new_tokens"),
    ({"stop_token_ids": [1, BIG]}, "sampling_params.stop_token_ids"),
    ({"n": BIG}, "sampling_params.n"),
    ({"stream_interval": BIG}, "sampling_params.stream_interval"),
]
BAD_BODIES = [
    ({"input_ids": [BIG]}, "input_ids"),
    ({"input_ids": [1.5]}, "input_ids"),
    ({"input_ids": [[1], [2, BIG]]}, "input_ids[1]"),
    (
        {"input_ids": [[1], [2]], "sampling_params": [{}, {"sampling_seed": BIG}]},
        "sampling_params[1].sampling_seed",
    ),
    ({"input_ids": [1], "sampling_params": "hot"}, "sampling_params"),
    ({"input_ids": [1], "logprob_start_len": BIG}, "logprob_start_len"),
    ({"input_ids": [1], "top_logprobs_num": -BIG}, "top_logprobs_num"),
    ({"input_ids": [1], "rid": 5}, "rid"),
    ({"input_ids": [1], "return_logprob": "yes please"}, "return_logprob"),
]
# floats JSON itself cannot write as numbers (json.dumps would send Infinity/NaN literals, checked too)
BAD_RAW = [
    (b'{"input_ids": [1], "sampling_params": {"temperature": 1e309}}', "sampling_params.temperature"),
    (b'{"input_ids": [1], "sampling_params": {"temperature": -1e309}}', "sampling_params.temperature"),
    (b'{"input_ids": [1], "sampling_params": {"temperature": NaN}}', "sampling_params.temperature"),
    (b'{"input_ids": [1], "sampling_params": {"top_p": NaN}}', "sampling_params.top_p"),
    (b'{"input_ids": [1], "sampling_params": {"min_p": Infinity}}', "sampling_params.min_p"),
    (b'{"input_ids": [1], "sampling_params": {"max_new_tokens": 1e400}}', "sampling_params.max_new_tokens"),
]


def test_bad_input_battery_gets_400_naming_the_field_and_the_engine_still_serves(engine):
    bodies = [(json_body, None, words) for json_body, words in BAD_BODIES]
    bodies += [({"input_ids": [1], "sampling_params": sp}, None, words) for sp, words in BAD_FIELDS]
    bodies += [(None, raw, words) for raw, words in BAD_RAW]
    for json_body, raw, words in bodies:
        resp = httpx.post(engine.url + "/generate", json=json_body, content=raw, timeout=30)
        assert resp.status_code == 400, (json_body or raw, resp.text)
        assert words in resp.json()["error"]["message"], (json_body or raw, resp.text)
    _serves(engine)
    assert engine.alive()


def test_int64_overflowing_seed_is_400_and_never_reaches_the_engine_thread(engine):
    body = {"input_ids": [1, 2], "sampling_params": {"sampling_seed": 2**80, "max_new_tokens": 2}}
    log_before = len(engine.log_path.read_text())
    resp = _generate(engine, body)
    assert resp.status_code == 400 and "sampling_params.sampling_seed" in resp.json()["error"]["message"]
    assert "engine step failed" not in engine.log_path.read_text()[log_before:]
    _serves(engine)
    body["sampling_params"]["sampling_seed"] = 2**63 - 1  # the largest int64 is a valid seed
    assert _generate(engine, body).status_code == 200


def test_oversized_bodies_get_413_and_the_engine_still_serves(engine):
    big = b'{"text": "' + b"a" * 50_000_000 + b'"}'  # 50 MB, over the default 32 MiB
    resp = httpx.post(engine.url + "/generate", content=big, timeout=120)
    assert resp.status_code == 413 and "--max-request-bytes" in resp.json()["error"]["message"]

    def chunks():  # no Content-Length: counted while it is read
        yield b'{"text": "'
        for _ in range(40):
            yield b"a" * 2**20
        yield b'"}'

    resp = httpx.post(engine.url + "/generate", content=chunks(), timeout=120)
    assert resp.status_code == 413, resp.text
    assert httpx.post(engine.url + "/update_weight_version", content=big, timeout=120).status_code == 413
    _serves(engine)


def test_step_error_fails_its_requests_with_500_and_the_engine_goes_on(engine):
    _serves(engine)
    _inject(engine, "step_error")
    resp = _generate(engine)
    assert resp.status_code == 500, resp.text
    message = resp.json()["error"]["message"]
    assert "engine step failed" in message and "injected fault" in message
    log = engine.log_path.read_text()
    assert "Traceback" in log and "InjectedFault: injected fault: step_error" in log
    assert httpx.get(engine.url + "/health", timeout=10).status_code == 200
    _serves(engine)
    assert httpx.get(engine.url + "/health_generate", timeout=60).status_code == 200
    # a batch with a failed request is a 500 too (SGLang: an abort with a status code fails the call)
    _inject(engine, "step_error")
    resp = _generate(engine, {"input_ids": [[1, 2], [3, 4]], "sampling_params": {"max_new_tokens": 2}})
    assert resp.status_code == 500 and "injected fault" in resp.json()["error"]["message"]
    _serves(engine)


def test_unknown_fault_kind_is_400(engine):
    resp = httpx.post(engine.url + "/debug/inject_fault", json={"kind": "meteor"}, timeout=10)
    assert resp.status_code == 400 and "step_error" in resp.json()["error"]["message"]


def test_dead_engine_thread_is_unhealthy_refuses_work_and_stops_on_sigterm(tiny_model, tmp_path):
    engine = _start(tiny_model, tmp_path)
    try:
        _serves(engine)
        _inject(engine, "scheduler_death")
        assert "died" in _wait_unhealthy(engine)
        resp = httpx.get(engine.url + "/health_generate", timeout=30)
        assert resp.status_code == 503 and "InjectedFault" in resp.json()["error"]["message"]
        resp = _generate(engine, timeout=10)  # answered at once, not left waiting for a dead thread
        assert resp.status_code == 503 and "died" in resp.json()["error"]["message"]
        assert "Traceback" in engine.log_path.read_text()
        engine.proc.send_signal(signal.SIGTERM)
        engine.proc.wait(timeout=30)
        assert not engine.alive()
    finally:
        engine.stop()


def test_stuck_engine_thread_is_unhealthy_until_it_moves_and_stops_on_sigterm(tiny_model, tmp_path):
    engine = _start(tiny_model, tmp_path, "--scheduler-stuck-timeout-s", "1")
    replies: list[httpx.Response | Exception] = []

    def send(max_new_tokens=3):
        try:
            body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": max_new_tokens}}
            replies.append(_generate(engine, body, timeout=600))
        except httpx.HTTPError as e:
            replies.append(e)

    try:
        _serves(engine)
        _inject(engine, "step_hang", seconds=8)  # outlasts the 1 s stuck timeout and the checks below
        waiting = threading.Thread(target=send, daemon=True)
        waiting.start()  # its step hangs
        assert "stuck" in _wait_unhealthy(engine)
        resp = _generate(engine, timeout=10)
        assert resp.status_code == 503 and "stuck" in resp.json()["error"]["message"]
        waiting.join(timeout=120)
        assert replies[0].status_code == 200  # the hung step went on: the request completes
        _serves(engine)

        _inject(engine, "step_hang", seconds=600)
        threading.Thread(target=send, daemon=True).start()
        _wait_unhealthy(engine)
        engine.proc.send_signal(signal.SIGTERM)
        engine.proc.wait(timeout=60)
        assert not engine.alive()
    finally:
        engine.stop()
