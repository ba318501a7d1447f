"""Shared fixtures: a tiny real model written once per test session; the images of the apptainer
sandbox backend."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

collect_ignore = ["foreign_tasks"]
"""Task folders written by others, whose tests/ are their verifiers' (run in sandboxes), not Miles' tests."""

os.environ.setdefault("MILES_TASKS_INTERNET", "off")
"""Tests send nothing off this machine: Harbor episodes get no network unless a test asks for egress
(tests/unit/test_sandbox_egress.py, whose traffic stays on this host)."""

IMAGES = Path(os.environ.get("MILES_TEST_IMAGES", "/var/cache/miles-images"))
"""Images the shipped Harbor tasks name, as `apptainer pull` names them (containers/stand-in-images.sh)."""


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked `gpu2` need two CUDA GPUs of one host (bench/multi_gpu_sitting.sh runs them all):
    skipped, saying so, on a host with fewer."""
    marked = [item for item in items if item.get_closest_marker("gpu2") is not None]
    if not marked:
        return
    import torch

    if torch.cuda.device_count() < 2:
        skip = pytest.mark.skip(reason="needs 2 GPUs of one host (gpu2; bench/multi_gpu_sitting.sh)")
        for item in marked:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def apptainer_images() -> str:
    """The image directory of the apptainer backend's tests. Skips where apptainer or the images are
    missing, unless MILES_REQUIRE_APPTAINER=1 (CI installs both), where that is a failure."""
    missing = []
    if shutil.which("apptainer") is None:
        missing.append("apptainer (bash containers/apptainer.sh)")
    if not (IMAGES / "python_3.11-slim.sif").is_file():
        missing.append(f"the test images in {IMAGES} (bash containers/stand-in-images.sh {IMAGES})")
    if missing:
        message = "needs " + " and ".join(missing)
        if os.environ.get("MILES_REQUIRE_APPTAINER") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return str(IMAGES)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """Path of a tiny random Qwen2-family model + tokenizer (fp32 safetensors)."""
    from miles.models.tiny import init_tiny

    return str(init_tiny(tmp_path_factory.mktemp("models") / "tiny", arch="qwen2", seed=0))
