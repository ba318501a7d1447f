"""End to end on CPU: recipes/fp8-tiny.yaml (FP8 engine, fake-quant trainer, FP8 weight sync checked by
checksums) against the same run with train.quantization=none (FP8 rollout without the contract's
forward); the same pair with an int4 engine (int4_qat against none). All are real `miles train` child
processes; the test reads their metrics.jsonl."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from conftest import deep_update, finish, miles_train

from miles.metrics import read_metrics

pytestmark = pytest.mark.slow

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "fp8-tiny.yaml"
STEPS = 4


def _run(tmp_path: Path, tiny_model: str, quantization: str, engine: dict | None = None) -> list[dict]:
    data = yaml.safe_load(RECIPE.read_text())
    tag = (engine or {}).get("quantization", "fp8")
    data = deep_update(
        data,
        {
            "run": {
                "name": f"{tag}-{quantization}",
                "runs_root": str(tmp_path / "runs"),
                "tensorboard": False,
            },
            "model": {"path": tiny_model, "init_tiny_if_missing": False},
            "engine": engine or {},
            "train": {"steps": STEPS, "quantization": quantization},
        },
    )
    path = tmp_path / f"{tag}-{quantization}.yaml"
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


def test_int4_qat_makes_the_trainer_see_the_engine(tmp_path, tiny_model):
    """int4 engine (every linear layer, groups of 32): with int4_qat the fp32 trainer computes exactly
    the engine's values, so the mismatch is rounding noise; the pushes carry the packed parts, checked
    byte for byte by the engine's checksums."""
    engine = {"quantization": "int4", "int4_group_size": 32}
    qat = _run(tmp_path, tiny_model, "int4_qat", engine)
    plain = _run(tmp_path, tiny_model, "none", engine)
    for r in qat + plain:
        assert r["weights/checksum_mismatch"] == 0.0
        assert r["weights/push_bytes"] > 0
    mean = [sum(r["train/logprob_mismatch"] for r in rs) / STEPS for rs in (qat, plain)]
    print(f"mean train/logprob_mismatch over {STEPS} steps: int4_qat {mean[0]:.3e}, none {mean[1]:.3e}")
    assert mean[0] < 1e-5 < mean[1]
