"""The trainer's side of the packed contracts (int4, mxfp8, nvfp4): the fake-quant forward of a Hugging
Face model, dense layers and stacked MoE experts, computes what the embedded engine computes from the
parts the export ships; the gradient passes straight through; int4 parts are about 4x smaller than
bf16; and the config rules of int4_qat."""

from __future__ import annotations

import pytest
import torch

from miles.config import ConfigError, resolve
from miles.engine.model import ModelSpec
from miles.engine.packed_weights import PackedDecoder
from miles.quant.contract import engine_quant_argv
from miles.quant.formats import Format, Scheme, engine_scheme
from miles.train.fsdp.weights import checkpoint_names
from miles.train.quant import export_pairs, install_fake_quant

FORMATS = [Format("int4", 32), Format("mxfp8"), Format("nvfp4")]
IDS = torch.tensor([[12, 40, 7, 99, 5, 230, 61, 18, 3, 77]])


def _hf(path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    from miles.models.tiny import init_tiny

    return str(init_tiny(tmp_path_factory.mktemp("models") / "moe", arch="qwen3_moe", seed=1))


def _exported(model: torch.nn.Module, scheme: Scheme) -> dict[str, torch.Tensor]:
    named = (pair for n, t in model.state_dict().items() for pair in checkpoint_names(n, t))
    return dict(export_pairs(named, scheme))


def _engine_logits(path: str, tensors: dict[str, torch.Tensor], scheme: Scheme) -> torch.Tensor:
    from miles.engine.model import Batch

    dec = PackedDecoder(ModelSpec.from_dir(path), tensors, "cpu", torch.float32, scheme)
    n = IDS.shape[1]
    ar = torch.arange(n)
    batch = Batch(
        input_ids=IDS[0],
        positions=ar,
        write_slots=ar + 1,
        query_index=ar[None],
        query_pos=ar[None],
        context_slots=(ar + 1)[None],
        last_index=torch.tensor([n - 1]),
    )
    return dec.forward(batch, dec.new_kv_pool(n + 1))[0]


@pytest.mark.parametrize("fmt", FORMATS, ids=[f.name for f in FORMATS])
@pytest.mark.parametrize("which", ["dense-linear", "moe-experts", "moe-linear"])
def test_trainer_forward_equals_the_engine_fed_by_the_export(tiny_model, moe_model, fmt, which):
    path = tiny_model if which.startswith("dense") else moe_model
    scheme = Scheme(fmt, which.split("-")[1])
    model = _hf(path)
    plain = model(IDS).logits[0, -1].detach()
    converted = install_fake_quant(model, scheme)
    assert converted == {"dense-linear": 14, "moe-experts": 1, "moe-linear": 12}[which]
    trained = model(IDS).logits[0, -1]
    served = _engine_logits(path, _exported(model, scheme), scheme)
    assert (trained.detach() - served).abs().max() <= 2e-5
    assert (trained.detach() - plain).abs().max() > 1e-4  # the forward really is quantised
    # straight-through: every covered weight gets the gradient of the quantised forward
    trained.square().sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(
        g is not None and g.abs().sum() > 0 for n, g in grads.items() if "experts" in n or "q_proj" in n
    )


def test_int4_parts_are_about_four_times_smaller_than_bf16():
    w = torch.randn(256, 512, dtype=torch.bfloat16)
    for group, floor in ((32, 3.5), (128, 3.8)):
        parts = Scheme(Format("int4", group)).encode("model.layers.0.mlp.down_proj.weight", w)
        packed = sum(t.numel() * t.element_size() for _, t in parts)
        assert w.numel() * 2 / packed >= floor


def test_a_dense_model_with_experts_only_is_refused_by_the_trainer(tiny_model):
    with pytest.raises(ConfigError, match="quant_modules=linear"):
        install_fake_quant(_hf(tiny_model), Scheme(Format("int4", 32), "experts"))


def test_int4_qat_config_rules(tiny_model, moe_model):
    base = {"model": {"path": tiny_model}, "engine": {"quantization": "int4", "int4_group_size": 32}}
    plan = resolve(base | {"train": {"quantization": "int4_qat"}})
    assert engine_scheme(plan) == Scheme(Format("int4", 32), "linear")  # auto: a dense model
    assert engine_quant_argv(plan)[-6:] == [
        "--quant-modules",
        "linear",
        "--int4-group-size",
        "32",
        "--int4-max-rows",
        "4",
    ]
    moe = resolve(base | {"model": {"path": moe_model}, "train": {"quantization": "int4_qat"}})
    assert engine_scheme(moe).modules == "experts"  # auto: upstream's default on a MoE model
    with pytest.raises(ConfigError, match="engine.quantization=int4"):
        resolve(
            {
                "model": {"path": tiny_model},
                "engine": {"quantization": "mxfp8"},
                "train": {"quantization": "int4_qat"},
            }
        )
    assert (
        engine_scheme(resolve({"model": {"path": tiny_model}, "engine": {"quantization": "nvfp4"}})).name
        == "nvfp4"
    )
