"""DeepSeek-V4 as the Megatron backend builds it: the architecture registered for `deepseek_v4`
(miles/train/megatron/architectures.py) builds, loads and exports a tiny DeepSeek-V4 over PP=2 x EP=2
ranks on the CPU (real megatron-core parallel state over gloo; megatron_v4_arch_ranks.py under
torchrun) as on one rank: the same loss (the streams crossing the stage boundary folded), and a weight
export that gives back every tensor of the checkpoint byte for byte under transformers' names. What the
architecture lacks is refused naming the key. Skipped without megatron-core."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"
)

RANKS = Path(__file__).with_name("megatron_v4_arch_ranks.py")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from miles.models.tiny import init_tiny

    return Path(init_tiny(tmp_path_factory.mktemp("v4-arch") / "v4", arch="deepseek_v4", seed=1))


def _run(model: Path, out: Path, pp: int, ep: int) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={pp * ep}"]
    done = subprocess.run([*cmd, str(RANKS), str(model), str(out), str(pp), str(ep)],
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2])  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "rank0.json").read_text())


@pytest.mark.slow
def test_pp2_ep2_loads_runs_and_exports_as_the_checkpoint(model, tmp_path):
    from miles.models.families.deepseek_v4 import hf_names
    from miles.train.megatron.model import read_hf_state

    single, split = _run(model, tmp_path / "one", 1, 1), _run(model, tmp_path / "pp2ep2", 2, 2)
    assert abs(split["loss"] - single["loss"]) <= 1e-5 * abs(single["loss"])
    checkpoint = hf_names(read_hf_state(str(model)))
    digest = {n: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
              for n, t in checkpoint.items()}  # fmt: skip
    for res in (single, split):
        assert res["exported"] == digest, sorted(set(res["exported"]) ^ set(digest))[:5]
    from transformers import AutoConfig

    from miles.export import megatron_state

    cfg = AutoConfig.from_pretrained(model)
    for run in ("one", "pp2ep2"):  # `miles export`'s reading of the files a checkpoint keeps
        files = tmp_path / run / "run" / "checkpoints" / "step_1" / "megatron"
        state = megatron_state(files, cfg)
        assert state.keys() == checkpoint.keys() and all(torch.equal(state[k], checkpoint[k]) for k in state)


def test_registry_names_the_v4_modules_and_refuses_what_they_lack():
    from types import SimpleNamespace

    from miles.train.megatron import architectures

    v4 = architectures.of(SimpleNamespace(model_type="deepseek_v4"))
    assert v4.name == "deepseek_v4" and "deepseek_v4_model.py" in v4.spec
    assert architectures.of(SimpleNamespace(model_type="qwen3_moe")).name == "gpt"
    plain = SimpleNamespace(lora=None, quantization="none", loss=SimpleNamespace(advantage="grpo"),
                            tensor_parallel=1, recompute="none")  # fmt: skip
    assert architectures.refusal(v4, plain) is None
    for key, value in [("lora", object()), ("recompute", "full"), ("tensor_parallel", 2)]:
        why = architectures.refusal(v4, SimpleNamespace(**(vars(plain) | {key: value})))
        assert why is not None and f"train.{key}" in why
    critic = SimpleNamespace(**(vars(plain) | {"loss": SimpleNamespace(advantage="ppo")}))
    assert "train.loss.advantage=ppo" in architectures.refusal(v4, critic)
