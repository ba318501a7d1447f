"""Shared fixtures of the SGLang protocol conformance tests: one real engine process per test module
(plain HTTP against it), on the tiny model of tests/conftest.py. A module that needs engine flags of
its own defines its own `engine` fixture."""

from __future__ import annotations

import pytest

from miles.engine.process import start_engine


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    proc = start_engine(tiny_model, device="cpu", log_path=tmp_path_factory.mktemp("protocol") / "engine.log")
    yield proc
    proc.stop()
