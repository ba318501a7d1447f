"""Shared fixtures: a tiny real model written once per test session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """Path of a tiny random Qwen2-family model + tokenizer (fp32 safetensors)."""
    from miles.models.tiny import init_tiny

    return str(init_tiny(tmp_path_factory.mktemp("models") / "tiny", arch="qwen2", seed=0))
