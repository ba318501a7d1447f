"""The real sglang-router in front of two embedded engines: it registers them from /health,
/server_info and /model_info without a warning, and policy `manual` keeps a session (one
X-SMG-Routing-Key header value) on one worker while different sessions spread over both."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from miles.engine.process import start_engine
from miles.rollout.router import ROUTING_KEY_HEADER, start_router


@pytest.fixture(scope="module")
def two_engines(tiny_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("router")
    engines = []
    try:
        for i in range(2):
            engines.append(start_engine(tiny_model, device="cpu", seed=i, log_path=logs / f"engine-{i}.log"))
        yield engines
    finally:
        for e in engines:
            e.stop()


@pytest.fixture(scope="module")
def router(two_engines, tmp_path_factory):
    log = tmp_path_factory.mktemp("router") / "router.log"
    with start_router([e.url for e in two_engines], policy="manual", log_path=log) as r:
        yield r


def _cached(engine) -> int:
    return httpx.get(engine.url + "/server_info", timeout=10).json()["internal_states"][0][
        "num_prefix_cached_tokens"
    ]


def _generate(router, key: str) -> dict:
    body = {"text": f"{key}: a session of its own", "sampling_params": {"max_new_tokens": 2}}
    resp = httpx.post(router.url + "/generate", json=body, headers={ROUTING_KEY_HEADER: key}, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["meta_info"]


def _session_home(router, engines, key: str, repeats: int) -> int:
    """Engine that served session `key`: the one whose prefix cache took the session's first prompt.
    Every later request of the session must find that prompt cached, i.e. land on the same engine."""
    before = [_cached(e) for e in engines]
    first = _generate(router, key)
    # a first request may find a token of another session's prompt cached, never its own prompt
    assert first["cached_tokens"] < first["prompt_tokens"] - 1, first
    grew = [i for i, e in enumerate(engines) if _cached(e) > before[i]]
    assert len(grew) == 1, f"session {key}: the prefix caches of engines {grew} grew, expected one"
    for _ in range(repeats):
        meta = _generate(router, key)
        assert meta["cached_tokens"] >= meta["prompt_tokens"] - 1, (key, meta)
    return grew[0]


def test_router_registers_workers_from_server_and_model_info(router, two_engines):
    workers = router.workers()
    assert sorted(w["url"] for w in workers) == sorted(e.url for e in two_engines)
    for w in workers:
        assert w["is_healthy"]
        # model_type and architectures come from /model_info, tp/dp sizes from /server_info
        assert w["metadata"]["model_type"] == "qwen2"
        assert "Qwen2ForCausalLM" in w["metadata"]["architectures"]
        assert w["metadata"]["tp_size"] == "1" and w["metadata"]["dp_size"] == "1"
    log = router.log_path.read_text(errors="replace")
    plain = re.sub(r"\x1b\[[0-9;]*m", "", log)
    problems = [ln for ln in plain.splitlines() if re.search(r"\b(WARN|ERROR)\b|fallback|[Ff]ailed", ln)]
    assert not problems, "router log:\n" + "\n".join(problems[:10])


def test_one_session_stays_on_one_worker_and_sessions_spread(router, two_engines):
    # new sessions until both workers hold some (at least four): the router may take a worker into its
    # policy a moment after reporting it healthy, so the first sessions can all go to one worker
    homes: dict[str, int] = {}
    for n in range(12):
        if n >= 4 and set(homes.values()) == {0, 1}:
            break
        homes[f"session-{n}"] = _session_home(router, two_engines, f"session-{n}", repeats=3)
        time.sleep(0.5)
    if set(homes.values()) != {0, 1}:  # where a new session goes is the router's choice
        pytest.skip(f"sglang-router put all {len(homes)} sessions on one worker: {homes}")


def test_engine_log_has_no_invalid_http_noise(router, two_engines):
    for e in two_engines:
        assert "Invalid HTTP request" not in e.log_path.read_text(errors="replace"), e.log_path


@pytest.mark.parametrize("policy", ["cache_aware", "manual"])
def test_rendered_router_command_parses_with_the_installed_router(policy):
    """The job-side router command (miles.rollout.sglang) against the installed sglang-router's parser."""
    from sglang_router.launch_router import parse_router_args

    from miles.config import resolve
    from miles.rollout.sglang import router_command

    plan = resolve({}, [f"engine.router_policy={policy}"])
    argv = router_command(plan, host="127.0.0.1", port=30029, worker_urls=["http://127.0.0.1:30000"])
    assert argv[:2] == ["sglang-router", "launch"]
    args = parse_router_args(argv[2:])
    assert (args.policy, args.port, args.prometheus_port) == (policy, 30029, 30028)
    assert args.worker_urls == ["http://127.0.0.1:30000"]
    if policy == "manual":
        assert args.assignment_mode == "min_group"
