"""The trainer's FP8 side: fake-quant forward (values, straight-through gradient, names), the export's
FP8 pairs, the config rules of train.quantization, and the TIS clip metrics."""

from __future__ import annotations

import copy

import pytest
import torch

from miles.config import ConfigError, resolve
from miles.quant.fp8 import dequantize_weight, fake_quant, is_quantized_name, quantize_weight, scale_name
from miles.train.quant import covered_linears, export_pairs, install_fake_quant, install_torchao_float8

LAYOUTS = ("fp8_block", "fp8_row")


def _model(seed: int = 0) -> torch.nn.Module:
    """A small Qwen2 whose projections span several 128x128 blocks (and partial ones)."""
    from transformers import AutoModelForCausalLM

    from miles.models.tiny import model_config

    cfg = model_config(
        "qwen2",
        vocab_size=300,
        eos_id=1,
        pad_id=0,
        hidden_size=160,
        intermediate_size=272,
        num_attention_heads=5,
        num_key_value_heads=1,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():  # spread the weights so that blocks have different scales
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(torch.linspace(0.2, 3.0, p.shape[0]).unsqueeze(1))
    return model.eval()


def _dequantised(model: torch.nn.Module, layout: str) -> torch.nn.Module:
    """A copy whose covered weights are replaced by the dequantised contract values."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in out.named_parameters():
            if is_quantized_name(name):
                p.copy_(dequantize_weight(*quantize_weight(p, layout), layout, p.dtype))
    return out


IDS = torch.tensor([[5, 17, 42, 99, 3, 250, 8, 120, 77, 31, 64, 200]])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fake_quant_forward_equals_dequantised_model_bitwise(layout):
    model = _model()
    reference = _dequantised(model, layout)
    n = install_fake_quant(model, layout)
    assert n == 2 * 7  # 2 layers x (q, k, v, o, gate, up, down)
    with torch.no_grad():
        got = model(input_ids=IDS, use_cache=False).logits
        want = reference(input_ids=IDS, use_cache=False).logits
        plain = _model()(input_ids=IDS, use_cache=False).logits
    assert torch.equal(got, want)
    assert not torch.equal(got, plain)  # the quantisation is visible: the test can tell them apart


@pytest.mark.parametrize("layout", LAYOUTS)
def test_straight_through_gradient_equals_gradient_at_dequantised_weights(layout):
    model = _model()
    reference = _dequantised(model, layout)
    install_fake_quant(model, layout)
    for m in (model, reference):
        m(input_ids=IDS, use_cache=False).logits.float().logsumexp(-1).sum().backward()
    grads = dict(reference.named_parameters())
    checked = 0
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, grads[name].grad), name
        checked += is_quantized_name(name)
    assert checked == 14


def test_state_dict_names_and_values_unchanged():
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    install_fake_quant(model, "fp8_block")
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert {f"{n}.weight" for n, _ in covered_linears(model)} == {k for k in after if is_quantized_name(k)}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_export_pairs_dtypes_and_shapes(layout):
    sd = _model().state_dict()
    out = dict(export_pairs(sd.items(), layout))
    covered = [k for k in sd if is_quantized_name(k)]
    assert len(covered) == 14
    assert set(out) == set(sd) | {scale_name(k) for k in covered}
    for k in covered:
        q, s = out[k], out[scale_name(k)]
        rows, cols = sd[k].shape
        assert q.dtype == torch.float8_e4m3fn and q.shape == sd[k].shape
        assert s.dtype == torch.float32
        want = (-(-rows // 128), -(-cols // 128)) if layout == "fp8_block" else (rows, 1)
        assert tuple(s.shape) == want
    for k in set(sd) - set(covered):
        assert out[k] is sd[k]  # embeddings, norms, biases, lm_head pass through untouched
    assert "lm_head.weight" in out and out["lm_head.weight"].dtype == torch.float32


def test_export_pairs_without_fp8_engine_passes_through():
    sd = _model().state_dict()
    assert list(export_pairs(sd.items(), None)) == list(sd.items())


def test_exported_bf16_pair_is_what_the_bf16_fake_quant_forward_computes_with():
    w = _model().state_dict()["model.layers.0.mlp.gate_proj.weight"].to(torch.bfloat16)
    pairs = dict(export_pairs([("model.layers.0.mlp.gate_proj.weight", w)], "fp8_block"))
    q, s = (
        pairs["model.layers.0.mlp.gate_proj.weight"],
        pairs["model.layers.0.mlp.gate_proj.weight_scale_inv"],
    )
    assert torch.equal(dequantize_weight(q, s, "fp8_block", torch.bfloat16), fake_quant(w, "fp8_block"))


def test_install_fake_quant_refuses_a_model_without_covered_layers():
    with pytest.raises(ConfigError, match="train.quantization"):
        install_fake_quant(torch.nn.Sequential(torch.nn.Linear(4, 4)), "fp8_block")
    with pytest.raises(ValueError, match="fp8_block, fp8_row"):
        install_fake_quant(_model(), "fp8_tensor")


def test_torchao_float8_on_cpu_is_a_config_error():
    with pytest.raises(ConfigError, match="train.quantization=torchao_float8.*CUDA"):
        install_torchao_float8(_model(), torch.device("cpu"))


def _plan(**sections):
    return resolve({"model": {"init_tiny_if_missing": False}, **sections})


def test_fake_quant_needs_an_fp8_engine():
    with pytest.raises(ConfigError, match=r"train.quantization=fake_quant.*engine.quantization"):
        _plan(train={"quantization": "fake_quant"})


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fake_quant_with_an_fp8_engine_resolves(layout):
    from miles.quant.contract import engine_layout
    from miles.train.quant import fake_quant_layout

    plan = _plan(train={"quantization": "fake_quant"}, engine={"quantization": layout})
    assert engine_layout(plan) == fake_quant_layout(plan) == layout
    bf16_trainer = _plan(engine={"quantization": layout})  # FP8 rollout without the contract's forward
    assert engine_layout(bf16_trainer) == layout and fake_quant_layout(bf16_trainer) is None


def test_torchao_float8_config_errors():
    with pytest.raises(ConfigError, match="torchao_float8.*train.device=cpu"):
        _plan(train={"quantization": "torchao_float8", "device": "cpu"})
    with pytest.raises(ConfigError, match="torchao_float8.*train.backend=fsdp"):
        _plan(train={"quantization": "torchao_float8", "backend": "megatron", "device": "cuda"})
    with pytest.raises(ConfigError, match="train.quantization"):
        _plan(train={"quantization": "int4"})


def test_tis_clip_fractions_per_token_and_per_sequence():
    from miles.config.train import LossConfig
    from miles.train.objective import TokenBatch, policy_objective

    # 3 sequences of 3, 2, 3 tokens; TIS truncates where old - rollout > log(2)
    gap = torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0, 2.0, 0.9, 0.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    seq = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
    old = torch.full((8,), -2.0)
    tb = TokenBatch(
        logp=old.clone().requires_grad_(),
        old_logp=old,
        rollout_logp=old - gap,
        advantages=torch.ones(8),
        mask=mask,
        weights=mask / mask.sum(),
        seq_index=seq,
        n_seqs=3,
    )
    _, sums = policy_objective(tb, LossConfig(tis="truncate", tis_clip=2.0))
    assert sums["tis_clip_frac"].item() == 3.0  # three trained tokens clipped
    assert sums["tis_clip_seq_frac"].item() == 2.0  # in two of the three sequences
    tb.rollout_logp = old - gap * torch.tensor([1.0, 1, 1, 1, 1, 0, 0, 1])  # only an untrained token left
    tb.rollout_logp[7] = -9.0
    _, sums = policy_objective(tb, LossConfig(tis="truncate", tis_clip=2.0))
    assert sums["tis_clip_seq_frac"].item() == 1.0  # the masked token does not count


def test_mismatch_panel_lists_the_correction_metrics():
    from miles.metrics import _PANELS

    assert {"train/logprob_mismatch", "train/tis_clip_frac", "train/tis_clip_seq_frac"} <= set(
        _PANELS["mismatch"]
    )
