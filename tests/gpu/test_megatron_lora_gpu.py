"""LoRA in the Megatron backend on CUDA (miles/train/megatron/lora.py): the policy's forward equals PEFT's
model holding the exported adapter, only the adapters train (the base weights stay as loaded, the
optimiser holds the adapters alone), and the adapters leave under PEFT's saved names. Skipped without
CUDA or megatron-core."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from miles.sample import Sample

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"),
]

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = {"rank": 8, "alpha": 16, "target_modules": TARGETS}


def _backend(path: str, root: str):
    from miles.config import Plan
    from miles.train.megatron.backend import MegatronBackend

    plan = Plan.model_validate({
        "model": {"path": path, "dtype": "float32"},
        "train": {"backend": "megatron", "lr": 1e-2, "lora": LORA, "loss": {"entropy_coef": 0.01}},
        "run": {"runs_root": root, "name": "megatron-lora"},
    })  # fmt: skip
    b = MegatronBackend()
    b.setup(plan)
    from miles.config.resolve import write_plan

    write_plan(plan, f"{root}/megatron-lora/plan.yaml")  # what `miles export` reads
    return b


def test_megatron_lora_equals_peft_and_trains_only_the_adapter(tmp_path):
    from peft import get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from miles.config.train import LoraConfig
    from miles.lora.adapters import peft_config
    from miles.models.tiny import init_tiny

    torch.backends.cuda.matmul.allow_tf32 = False
    path = str(init_tiny(tmp_path / "m", arch="qwen2", seed=3))
    b = _backend(path, str(tmp_path / "runs"))
    trainable = [n for n, p in b.gpt.named_parameters() if p.requires_grad]
    layers = b.hf_cfg.num_hidden_layers
    assert len(trainable) == 2 * len(TARGETS) * layers and all(".lora_" in n for n in trainable)
    with torch.no_grad():  # a non-zero adapter, so that it shows in the logits
        for n, p in b.gpt.named_parameters():
            if ".lora_B_" in n:
                p.normal_(0.0, 0.05)
    exported = {n: t for bucket in b.export_weights(1 << 30) for n, t in bucket}
    assert len(exported) == 2 * len(TARGETS) * layers
    assert "policy/base_model.model.model.layers.1.self_attn.k_proj.lora_A.weight" in exported

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    plain_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    peft = get_peft_model(hf, peft_config(LoraConfig(**LORA))).eval()
    set_peft_model_state_dict(peft, {n.removeprefix("policy/"): t for n, t in exported.items()})
    ids = torch.randint(4, 380, (2, 33), device="cuda")
    pos = torch.arange(33, device="cuda").expand(2, 33)
    with torch.no_grad():
        ours = b.model.module(ids, pos, None).float()
        want = peft(ids).logits.float()
        plain = plain_model(ids).logits.float()
    err = ((ours - want).norm() / want.norm()).item()
    gap = ((plain - want).norm() / want.norm()).item()
    print(f"megatron LoRA vs PEFT: {err:.2e}; base model vs PEFT: {gap:.2e}")
    assert err < 1e-4 < gap

    base = {n: p.detach().clone() for n, p in b.gpt.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in b.gpt.named_parameters() if p.requires_grad}
    prompt, good, bad = [11, 22, 33, 44], [50, 60, 70, 80], [90, 100, 110]
    samples = [
        Sample(0, 0, prompt, good, [1] * 4, [-6.0] * 4, reward=1.0),
        Sample(0, 1, prompt, bad, [1] * 3, [-6.0] * 3, reward=0.0),
    ]
    metrics = b.train(samples)
    assert metrics["grad_norm"] > 0
    after = dict(b.gpt.named_parameters())
    assert all(torch.equal(after[n], t) for n, t in base.items())  # the base stays as loaded
    assert any(not torch.equal(after[n], t) for n, t in adapters.items())

    # the checkpoint holds the adapter; `miles export` writes it as PEFT's directory
    from peft import PeftModel

    from miles.export import export_run

    b.save(1)
    with torch.no_grad():
        trained = b.model.module(ids, pos, None).float()
    out = export_run(tmp_path / "runs" / "megatron-lora", tmp_path / "adapter")
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    served = PeftModel.from_pretrained(base, str(out)).eval()
    with torch.no_grad():
        got = served(ids).logits.float()
    assert ((got - trained).norm() / trained.norm()).item() < 1e-4


@pytest.mark.gpu2
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (1, 1)])
def test_megatron_lora_parallel_layouts_match_peft_step(tmp_path, tp, pp):
    """TP=2, PP=2 and DP=2 (tp=pp=1 on 2 ranks) each train the adapter as one step of PEFT's model does
    (loss, grad norm, update; tests/gpu/megatron_ranks.py with `lora`)."""
    import sys
    from pathlib import Path

    from miles.models.tiny import init_tiny

    sys.path.insert(0, str(Path(__file__).parent))
    from test_megatron_gpu import run_ranks

    path = str(init_tiny(tmp_path / "m", arch="qwen2", seed=1, hidden_size=128, intermediate_size=256))
    assert '"lora": true' in run_ranks(path, str(tmp_path / "runs"), str(tp), str(pp), "lora")
