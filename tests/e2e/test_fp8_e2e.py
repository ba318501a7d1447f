"""End to end on CPU: recipes/fp8-tiny.yaml (FP8 engine, fake-quant trainer, FP8 weight sync checked by
checksums) against the same run with train.quantization=none (FP8 rollout without the contract's
forward). Both are real `miles train` child processes; the test reads their metrics.jsonl."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from conftest import deep_update, finish, miles_train

from miles.metrics import read_metrics

pytestmark = pytest.mark.slow

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "fp8-tiny.yaml"
STEPS = 4


def _run(tmp_path: Path, tiny_model: str, quantization: str) -> list[dict]:
    data = yaml.safe_load(RECIPE.read_text())
    data = deep_update(
        data,
        {
            "run": {"name": f"fp8-{quantization}", "runs_root": str(tmp_path / "runs"), "tensorboard": False},
            "model": {"path": tiny_model, "init_tiny_if_missing": False},
            "train": {"steps": STEPS, "quantization": quantization},
        },
    )
    path = tmp_path / f"fp8-{quantization}.yaml"
    path.write_text(yaml.safe_dump(data))
    finish(miles_train(str(path)), timeout_s=600)
    records = [r for r in read_metrics(tmp_path / "runs" / data["run"]["name"]) if r["step"] > 0]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    return records


def test_contract_lowers_the_fp8_mismatch(tmp_path, tiny_model):
    with_contract = _run(tmp_path, tiny_model, "fake_quant")
    without = _run(tmp_path, tiny_model, "none")
    for records in (with_contract, without):
        for r in records:
            assert r["weights/checksum_mismatch"] == 0.0  # engine bytes == trainer bytes after every push
            assert 0.0 <= r["train/tis_clip_frac"] <= 1.0 and 0.0 <= r["train/tis_clip_seq_frac"] <= 1.0
    mean = [sum(r["train/logprob_mismatch"] for r in rs) / STEPS for rs in (with_contract, without)]
    print(f"mean train/logprob_mismatch over {STEPS} steps: fake_quant {mean[0]:.3e}, none {mean[1]:.3e}")
    for name, rs in (("fake_quant", with_contract), ("none", without)):
        keys = ("train/logprob_mismatch", "train/tis_clip_frac", "train/tis_clip_seq_frac")
        print(name, [[f"{r[k]:.3e}" for k in keys] for r in rs])
    assert mean[0] < mean[1]
