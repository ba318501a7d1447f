"""The loop finds engines only of its own incarnation; stale records are reported, never used."""

from __future__ import annotations

import logging

import pytest

from miles.cluster.environment import INCARNATION_VAR, JobEnvironment
from miles.cluster.rendezvous import publish_engine, publish_router
from miles.loop.rollout_side import engine_urls


@pytest.fixture
def local_incarnation(monkeypatch) -> str:
    for name in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(INCARNATION_VAR, "local.host.2.now")
    return JobEnvironment.from_env().incarnation


def test_only_this_incarnations_engines_and_router_are_used(tmp_path, local_incarnation, caplog) -> None:
    publish_engine(tmp_path, "engine-0", "http://127.0.0.1:1", 11, "local", "local.host.1.before")
    publish_engine(tmp_path, "engine-1", "http://127.0.0.1:2", 12, "local", local_incarnation)
    publish_router(tmp_path, "http://127.0.0.1:3", 13, "local.host.1.before")
    with caplog.at_level(logging.WARNING):
        urls, router = engine_urls(tmp_path, timeout_s=1)
    assert urls == ["http://127.0.0.1:2"] and router is None
    assert "engine-0.json" in caplog.text and "local.host.1.before" in caplog.text


def test_only_stale_records_fail_within_the_timeout_naming_the_incarnation(tmp_path, local_incarnation):
    publish_engine(tmp_path, "engine-0", "http://127.0.0.1:1", 11, "local", "local.host.1.before")
    with pytest.raises(RuntimeError, match=local_incarnation):
        engine_urls(tmp_path, timeout_s=1)


def test_slurm_incarnation_is_job_and_restart_count() -> None:
    env = JobEnvironment.from_env({"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "2", INCARNATION_VAR: "x"})
    assert env.incarnation == "77.2"
