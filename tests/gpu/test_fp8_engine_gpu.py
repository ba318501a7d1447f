"""The embedded engine's FP8 linear layers on CUDA (miles/engine/fp8_weights.py), bf16, on a Qwen2
model whose q rows and gate/up rows are multiples of 128 and k/v rows are not (so fp8_block keeps
q/k/v unfused and fuses gate/up; fp8_row fuses both): the fused forward against the per-op forward,
the dequantised path against a plain decoder holding the fake-quant values, the real FP8 GEMMs
against it within a stated tolerance, pair updates landing in the fused storage, an offload/onload
round trip, and an engine process whose CUDA-graph decode equals its eager decode. Skipped without CUDA.
"""

from __future__ import annotations

import httpx
import pytest
import torch

from miles.engine.fp8_weights import Fp8Decoder
from miles.engine.model import Batch, Decoder, ModelSpec, load_weights
from miles.quant.fp8 import fake_quant, is_quantized_name, quantize_weight, scale_name

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (FP8 GEMMs, Triton kernels)"),
]

SIZES = dict(hidden_size=256, intermediate_size=640, num_hidden_layers=2, num_attention_heads=8)
LAYOUTS = ["fp8_block", "fp8_row"]
FP8_GEMM_TOL = 0.1
"""Max |log-prob| difference of real FP8 GEMMs (activations quantised per token or per 1x128 group)
against bf16 GEMMs on the same dequantised weights: activation quantisation error (~3e-2 relative
per element) through two layers."""
BIG = 1 << 30


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    from miles.models.tiny import init_tiny

    out = tmp_path_factory.mktemp("fp8-gpu") / "m"
    return str(init_tiny(out, arch="qwen2", num_key_value_heads=2, **SIZES))


def _fp8(model: str, layout: str, min_tokens: int) -> Fp8Decoder:
    return Fp8Decoder(
        ModelSpec.from_dir(model), load_weights(model), "cuda", torch.bfloat16, layout, min_tokens
    )


def _prefill_logprobs(dec: Decoder, tokens: list[int]) -> torch.Tensor:
    """Log-probs at every position of one prompt (each position as the last token of a request)."""
    n = len(tokens)
    ar = torch.arange(n)
    b = Batch(
        input_ids=torch.tensor(tokens), positions=ar, write_slots=ar + 1,
        query_index=ar[None], query_pos=ar[None], context_slots=(ar + 1)[None], last_index=ar,
    )  # fmt: skip
    b = Batch(**{k: v.cuda() for k, v in vars(b).items() if v is not None})
    return torch.log_softmax(dec.forward(b, dec.new_kv_pool(n + 1)), dim=-1)


PROMPT = list(range(5, 5 + 200, 3))  # 67 tokens


@pytest.mark.parametrize("layout", LAYOUTS)
def test_storage_follows_the_fusion_rule(model, layout):
    dec = _fp8(model, layout, BIG)
    attn = "model.layers.0.self_attn."
    assert ((attn + "qkv_proj.weight") in dec.storage) == (layout == "fp8_row")
    assert "model.layers.0.mlp.gate_up_proj.weight_scale_inv" in dec.storage


@pytest.mark.parametrize("min_tokens", [1, BIG], ids=["fp8-gemm", "dequantised"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fused_forward_matches_per_op(model, layout, min_tokens):
    dec = _fp8(model, layout, min_tokens)
    fused = _prefill_logprobs(dec, PROMPT)
    dec.fused = False
    per_op = _prefill_logprobs(dec, PROMPT)
    err = float((fused - per_op).abs().max())
    print(f"{layout} min_tokens={min_tokens}: fused vs per-op max |log-prob diff| {err:.2e}")
    assert err <= 0.05


@pytest.mark.parametrize("layout", LAYOUTS)
def test_engine_values_are_the_fake_quant_values(model, layout):
    weights = load_weights(model)
    spec = ModelSpec.from_dir(model)
    fake = {n: fake_quant(w.cuda(), layout) if is_quantized_name(n) else w for n, w in weights.items()}
    reference = _prefill_logprobs(Decoder(spec, fake, "cuda", torch.bfloat16), PROMPT)
    dequantised = _prefill_logprobs(_fp8(model, layout, BIG), PROMPT)
    assert float((dequantised - reference).abs().max()) <= 1e-3  # the same bf16 weights, the same GEMMs
    gemm = _prefill_logprobs(_fp8(model, layout, 1), PROMPT)
    err = float((gemm - reference).abs().max())
    print(f"{layout}: FP8 GEMM vs fake-quant bf16 max |log-prob diff| {err:.2e}")
    assert err <= FP8_GEMM_TOL


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pair_update_lands_in_fused_storage_and_survives_offload(model, layout):
    dec = _fp8(model, layout, 1)
    name = "model.layers.1.mlp.up_proj.weight"
    q, s = quantize_weight(torch.randn(dec.params[name].shape, device="cuda") * 0.05, layout)
    dec.load({name: q, scale_name(name): s})
    fused = dec.storage["model.layers.1.mlp.gate_up_proj.weight"]
    assert torch.equal(fused[q.shape[0] :].view(torch.uint8), q.view(torch.uint8))
    before = {n: t.clone() for n, t in dec.params.items()}
    dec.offload()
    dec.onload()
    assert all(torch.equal(dec.params[n].view(torch.uint8), t.view(torch.uint8)) for n, t in before.items())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_graph_decode_equals_eager_decode(model, layout, tmp_path):
    from miles.engine.process import start_engine

    outputs = []
    for flags in ([], ["--disable-cuda-graph"]):
        args = ["--quantization", layout, "--fp8-min-tokens", "16", *flags]
        with start_engine(
            model, device="cuda", log_path=tmp_path / f"e{len(flags)}.log", extra_args=args
        ) as e:
            body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 16, "temperature": 0}}
            resp = httpx.post(e.url + "/generate", json=body, timeout=300)
            assert resp.status_code == 200, resp.text
            outputs.append(resp.json()["output_ids"])
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_decode_copy_follows_every_weight_change(model, layout):
    """Below min_tokens a CUDA engine multiplies a model-dtype copy of each FP8 weight: equal to the
    dequantised pair at load, after a pair update (in place: graphs stay valid), and after offload/onload;
    no copy when every GEMM runs in FP8."""
    from miles.quant.fp8 import dequantize_weight

    assert _fp8(model, layout, 1)._shadow == {}
    dec = _fp8(model, layout, BIG)

    def check() -> None:
        fp8 = [n for n, t in dec.storage.items() if t.dtype == torch.float8_e4m3fn]
        assert sorted(dec._shadow) == sorted(fp8), "one copy per stored FP8 weight"
        for n in fp8:
            want = dequantize_weight(dec.storage[n], dec.storage[scale_name(n)], layout, torch.bfloat16)
            assert torch.equal(dec._shadow[n], want), f"{n}: copy differs from the stored pair"

    check()
    name = "model.layers.1.mlp.up_proj.weight"
    key = "model.layers.1.mlp.gate_up_proj.weight"
    address, before = dec._shadow[key].data_ptr(), dec._shadow[key].clone()
    q, s = quantize_weight(torch.randn(dec.params[name].shape, device="cuda") * 0.05, layout)
    dec.load({name: q, scale_name(name): s})
    assert dec._shadow[key].data_ptr() == address, "an update must write the copy in place"
    assert not torch.equal(dec._shadow[key], before), "the update did not reach the copy"
    check()
    dec.offload()
    assert dec._shadow == {}, "offload frees the copies with the weights"
    dec.onload()
    check()
    x = torch.randn(3, SIZES["hidden_size"], device="cuda", dtype=torch.bfloat16)
    assert torch.equal(dec._linear(x, key), torch.nn.functional.linear(x, dec._shadow[key]))
