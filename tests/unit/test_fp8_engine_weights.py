"""The embedded engine's FP8 weights in process (miles/engine/fp8_weights.py), on the tiny model:
covered weights stored as the contract's bytes, the forward equal to a plain decoder holding the
fake-quant values, the block layout fused only on whole 128-row blocks, updates checked tensor by
tensor, and FP8 checkpoints whose quantisation does not match the engine refused by key."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from miles.engine.fp8_weights import Fp8Decoder, build_decoder, load_checkpoint
from miles.engine.model import Batch, Decoder, ModelSpec, load_weights
from miles.quant.fp8 import (
    FP8_DTYPE,
    dequantize_weight,
    fake_quant,
    is_quantized_name,
    quantize_weight,
    scale_name,
)

LAYOUTS = ["fp8_block", "fp8_row"]
Q0 = "model.layers.0.self_attn.q_proj.weight"
PROMPT = [12, 40, 7, 99, 5, 230, 61, 18]


@pytest.fixture(scope="module")
def checkpoint(tiny_model):
    return ModelSpec.from_dir(tiny_model), load_weights(tiny_model)


def _prefill(tokens: list[int]) -> Batch:
    ar = torch.arange(len(tokens))
    return Batch(
        input_ids=torch.tensor(tokens),
        positions=ar,
        write_slots=ar + 1,
        query_index=ar[None],
        query_pos=ar[None],
        context_slots=(ar + 1)[None],
        last_index=torch.tensor([len(tokens) - 1]),
    )


def _logits(decoder: Decoder, tokens: list[int]) -> torch.Tensor:
    return decoder.forward(_prefill(tokens), decoder.new_kv_pool(len(tokens) + 1))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_load_stores_the_contract_bytes_and_leaves_the_rest(checkpoint, layout):
    spec, weights = checkpoint
    dec = Fp8Decoder(spec, weights, "cpu", torch.float32, layout, min_tokens=1)
    covered = [n for n in weights if is_quantized_name(n)]
    assert len(covered) == 7 * spec.num_layers
    for name, w in weights.items():
        if is_quantized_name(name):
            q, s = quantize_weight(w, layout)
            assert dec.params[name].dtype == FP8_DTYPE
            assert torch.equal(dec.params[name].view(torch.uint8), q.view(torch.uint8)), name
            assert torch.equal(dec.params[scale_name(name)], s), name
            assert torch.equal(dec.get(name), dequantize_weight(q, s, layout, torch.float32))
        else:
            assert dec.params.get(name, dec.get(name)).dtype == torch.float32
            assert torch.equal(dec.get(name), w), name


@pytest.mark.parametrize("layout", LAYOUTS)
def test_forward_equals_a_decoder_holding_the_fake_quant_values(checkpoint, layout):
    spec, weights = checkpoint
    fp8 = Fp8Decoder(spec, weights, "cpu", torch.float32, layout, min_tokens=1)
    fake = {n: fake_quant(w, layout) if is_quantized_name(n) else w for n, w in weights.items()}
    reference = Decoder(spec, fake, "cpu", torch.float32)
    plain = Decoder(spec, weights, "cpu", torch.float32)
    got = _logits(fp8, PROMPT)
    assert torch.allclose(got, _logits(reference, PROMPT), atol=1e-5, rtol=0)
    assert (got - _logits(plain, PROMPT)).abs().max() > 1e-4  # the weights really are quantised


def test_block_layout_fuses_only_whole_blocks_and_rows_fuse_their_scales(checkpoint):
    spec, weights = checkpoint
    attn, mlp = "model.layers.0.self_attn.", "model.layers.0.mlp."
    assert weights[Q0].shape[0] % 128 != 0 and weights[mlp + "gate_proj.weight"].shape[0] % 128 == 0
    block = Fp8Decoder(spec, weights, "cpu", torch.float32, "fp8_block", min_tokens=1)
    assert attn + "qkv_proj.weight" not in block.storage and attn + "q_proj.weight_scale_inv" in block.storage
    assert attn + "qkv_proj.bias" in block.storage  # biases stay fused
    assert mlp + "gate_up_proj.weight_scale_inv" in block.storage
    row = Fp8Decoder(spec, weights, "cpu", torch.float32, "fp8_row", min_tokens=1)
    fused_scale = row.storage[attn + "qkv_proj.weight_scale_inv"]
    parts = [row.params[attn + f"{x}_proj.weight_scale_inv"] for x in "qkv"]
    assert torch.equal(fused_scale, torch.cat(parts))
    assert parts[0].untyped_storage().data_ptr() == fused_scale.untyped_storage().data_ptr()
    # the fused CUDA path's GEMM on a split group equals the members' GEMMs side by side
    x = torch.randn(3, spec.hidden_size)
    bias = block.storage[attn + "qkv_proj.bias"]
    want = torch.cat(
        [block._linear(x, attn + f"{p}_proj.weight", block.params[attn + f"{p}_proj.bias"]) for p in "qkv"],
        -1,
    )
    assert torch.equal(block._linear(x, attn + "qkv_proj.weight", bias), want)


def test_offload_and_onload_keep_the_bytes(checkpoint):
    spec, weights = checkpoint
    dec = Fp8Decoder(spec, weights, "cpu", torch.float32, "fp8_row", min_tokens=1)
    before = {n: t.clone() for n, t in dec.params.items()}
    dec.offload()
    dec.onload()
    assert all(torch.equal(dec.params[n].view(torch.uint8), t.view(torch.uint8)) for n, t in before.items())


def _bad_updates(w: torch.Tensor) -> list[tuple[dict[str, torch.Tensor], str]]:
    q, s = quantize_weight(w, "fp8_block")
    sname = scale_name(Q0)
    return [
        ({Q0: q, sname: s.bfloat16()}, f"{sname} must be float32"),
        ({Q0: q, sname: s[:, :0]}, f"{sname} of a"),
        ({Q0: q}, f"{sname} was not sent"),
        ({sname: s}, f"came without {Q0}"),
        ({Q0: w, sname: s}, "a scale goes with a float8_e4m3fn weight only"),
        ({Q0: w[0]}, "must be 2-D"),
        ({Q0: w.to(torch.int32)}, "neither float8_e4m3fn nor a float dtype"),
    ]


def test_bad_updates_name_the_tensor_and_change_nothing(checkpoint):
    spec, weights = checkpoint
    dec = Fp8Decoder(spec, weights, "cpu", torch.float32, "fp8_block", min_tokens=1)
    before = dec.params[Q0].clone()
    for update, message in _bad_updates(torch.randn_like(weights[Q0])):
        with pytest.raises(ValueError, match=message):
            dec.load(update)
    assert torch.equal(dec.params[Q0].view(torch.uint8), before.view(torch.uint8))


def _fp8_dir(tiny_model, tmp_path, quantization_config: dict):
    out = tmp_path / "fp8"
    shutil.copytree(tiny_model, out)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "quantization_config": quantization_config}))
    return out


def test_checkpoint_quantisation_mismatch_names_the_key(tiny_model, checkpoint, tmp_path):
    spec, _ = checkpoint
    base = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    block = _fp8_dir(tiny_model, tmp_path / "a", {**base, "weight_block_size": [128, 128]})
    with pytest.raises(ValueError, match=r"engine.quantization=none \(--quantization\): set it to fp8_block"):
        build_decoder(spec, block, "cpu", torch.float32, "none", 1)
    with pytest.raises(ValueError, match="set it to fp8_block"):
        load_checkpoint(block, "fp8_row")
    odd = _fp8_dir(tiny_model, tmp_path / "b", {**base, "weight_block_size": [64, 64]})
    with pytest.raises(ValueError, match=r"weight_block_size is \[64, 64\]"):
        load_checkpoint(odd, "fp8_block")
    other = _fp8_dir(tiny_model, tmp_path / "c", {"quant_method": "awq"})
    with pytest.raises(ValueError, match="quant_method 'awq'"):
        load_checkpoint(other, "none")


def test_fp8_checkpoint_loads_as_it_is(tiny_model, checkpoint, tmp_path):
    spec, weights = checkpoint
    out = _fp8_dir(tiny_model, tmp_path, {"quant_method": "fp8", "fmt": "e4m3"})  # no block size: rows
    pairs = {}
    for name, w in weights.items():
        if is_quantized_name(name):
            pairs[name], pairs[scale_name(name)] = quantize_weight(w, "fp8_row")
        else:
            pairs[name] = w
    for f in out.glob("*.safetensors"):
        f.unlink()
    save_file(pairs, str(out / "model.safetensors"))
    dec = build_decoder(spec, out, "cpu", torch.float32, "fp8_row", 1)
    assert all(torch.equal(dec.params[n].view(torch.uint8), t.view(torch.uint8)) for n, t in pairs.items())


def test_checksums_of_a_plain_engine_cover_every_hf_name(tiny_model, checkpoint):
    from miles.engine.updates import checksum_reply
    from miles.weights.checksum import checksum

    spec, weights = checkpoint
    reply = checksum_reply(Decoder(spec, weights, "cpu", torch.float32).params, [])
    assert reply["ranks"][0]["checksums"] == {n: checksum(w) for n, w in weights.items()}


def test_moe_experts_and_routers_stay_in_the_model_dtype(tmp_path):
    from miles.models.tiny import init_tiny

    moe_dir = init_tiny(tmp_path / "moe", arch="qwen3_moe", seed=0)
    spec, weights = ModelSpec.from_dir(moe_dir), load_weights(moe_dir)
    dec = Fp8Decoder(spec, weights, "cpu", torch.float32, "fp8_row", min_tokens=1)
    fp8 = {n for n, t in dec.params.items() if t.dtype == FP8_DTYPE}
    assert fp8 == {n for n in weights if is_quantized_name(n)} and fp8
    assert not any(".experts." in n or n.endswith("mlp.gate.weight") for n in fp8)
    fake = {n: fake_quant(w, "fp8_row") if is_quantized_name(n) else w for n, w in weights.items()}
    want = _logits(Decoder(spec, fake, "cpu", torch.float32), PROMPT)
    assert torch.allclose(_logits(dec, PROMPT), want, atol=1e-5, rtol=0)
