"""Megatron backend with the FP8 contract: the fake-quant forward sees the engine's weights, the export
ships the contract's pairs, and a training step runs through the straight-through estimator."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (megatron-core forward is CUDA-only)"
    ),
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"),
]

LAYOUTS = ("fp8_block", "fp8_row")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from miles.models.tiny import init_tiny

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    root = tmp_path_factory.mktemp("megfp8")
    # 320 x 192 projections: several 128x128 blocks per weight, partial ones at the edges
    path = str(init_tiny(root / "tiny", arch="qwen2", seed=3, hidden_size=192, intermediate_size=320))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    return path, str(root / "runs"), hf


def _backend(env, layout: str, quantization: str = "fake_quant"):
    from miles.config import Plan
    from miles.train.megatron.backend import MegatronBackend

    plan = Plan.model_validate(
        {
            "model": {"path": env[0], "dtype": "float32"},
            "engine": {"quantization": layout},
            "train": {"backend": "megatron", "lr": 1e-3, "quantization": quantization},
            "run": {"runs_root": env[1], "name": f"{layout}-{quantization}"},
        }
    )
    b = MegatronBackend()
    b.setup(plan)
    return b


def _dequantised_hf(hf, layout: str):
    import copy

    from miles.quant.fp8 import dequantize_weight, is_quantized_name, quantize_weight

    out = copy.deepcopy(hf)
    with torch.no_grad():
        for name, p in out.named_parameters():
            if is_quantized_name(name):
                p.copy_(dequantize_weight(*quantize_weight(p, layout), layout, p.dtype))
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fake_quant_logits_match_hf_with_dequantised_weights(env, layout):
    b = _backend(env, layout)
    ids = torch.randint(4, 380, (2, 33), device="cuda")
    pos = torch.arange(33, device="cuda").expand(2, 33)
    with torch.no_grad():
        ours = b.model.module(ids, pos, None).float()
        ref = _dequantised_hf(env[2], layout)(ids).logits.float()
        plain = env[2](ids).logits.float()
    err = ((ours - ref).norm() / ref.norm()).item()
    gap = ((plain - ref).norm() / ref.norm()).item()
    print(f"megatron fake-quant vs dequantised HF ({layout}): {err:.2e}; bf16 weights vs FP8: {gap:.2e}")
    assert err < 1e-4 < gap


@pytest.mark.parametrize("layout", LAYOUTS)
def test_export_ships_the_contract_pairs(env, layout):
    from miles.quant.fp8 import is_quantized_name, quantize_weight, scale_name

    b = _backend(env, layout)
    out = {k: v.detach().cpu() for bk in b.export_weights(1 << 16) for k, v in bk}
    hf_state = {k: v.cpu() for k, v in env[2].state_dict().items()}
    covered = [k for k in hf_state if is_quantized_name(k)]
    assert covered and set(out) == set(hf_state) | {scale_name(k) for k in covered}
    for k in covered:
        q, s = quantize_weight(hf_state[k], layout)
        assert out[k].dtype == torch.float8_e4m3fn
        assert torch.equal(out[k].view(torch.uint8), q.view(torch.uint8)) and torch.equal(
            out[scale_name(k)], s
        )


def test_train_step_through_the_straight_through_estimator(env):
    import random

    from miles.sample import Sample

    b = _backend(env, "fp8_block")
    rng = random.Random(0)
    samples = []
    for i in range(8):
        p = [rng.randrange(4, 380) for _ in range(5)]
        r = [rng.randrange(4, 380) for _ in range(6)]
        samples.append(Sample(i // 4, i % 4, p, r, [1] * 6, [-5.0] * 6, reward=rng.random()))
    metrics = b.train(samples)
    assert metrics["grad_norm"] > 0 and 0.0 <= metrics["tis_clip_seq_frac"] <= 1.0
    assert torch.isfinite(torch.tensor(metrics["loss"]))
