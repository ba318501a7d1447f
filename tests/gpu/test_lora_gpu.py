"""LoRA in the embedded engine on CUDA (bf16, fused forward, CUDA graphs): a mixed batch of two adapters
and the base model decodes greedily to the same tokens with graphs as eagerly, and an adapter's
prompt log-probs match a decoder whose weights hold W + s B A; the A stacked under the weights goes to
host memory and back with them. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from miles.engine.lora import AdapterConfig, LoraBank
from miles.engine.model import Batch, Decoder, ModelSpec, load_weights

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
RANK = 8
PROMPT = list(range(5, 5 + 120, 3))


@pytest.fixture(scope="module", params=[2, 4], ids=["kv2", "kv4"])
def model(request, tmp_path_factory) -> str:
    """The tiny model with 4 heads of 32 and 2 or 4 key/value heads: with 4 every projection's output
    is a multiple of 128 (the kernels' column block), so q/k/v's adapters too stack under the weight
    and reach the RoPE kernel; with 2, k and v (64 rows) do not fit and q/k/v keep their own A."""
    from miles.models.tiny import init_tiny

    sizes = dict(
        hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=request.param
    )
    return str(init_tiny(tmp_path_factory.mktemp("lora-gpu") / "m", arch="qwen2", **sizes))


def _decoder(model: str) -> Decoder:
    dec = Decoder(ModelSpec.from_dir(model), load_weights(model), "cuda", torch.bfloat16)
    dec.lora = LoraBank.for_decoder(dec, 4, RANK, TARGETS, 16)
    return dec


def _adapter(dec: Decoder, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for m, (o, i) in dec.lora.modules.items():
        out[f"base_model.model.{m}.lora_A.weight"] = (torch.randn(RANK, i, generator=g) * 0.05).bfloat16()
        out[f"base_model.model.{m}.lora_B.weight"] = (torch.randn(o, RANK, generator=g) * 0.05).bfloat16()
    return out


def test_graph_decode_equals_eager_with_mixed_adapters(model):
    from miles.engine.sampling import SamplingParams
    from miles.engine.scheduler import Request, Scheduler

    outputs = []
    for graphs in (True, False):
        dec = _decoder(model)
        cfg = AdapterConfig(RANK, 16.0, TARGETS)
        dec.lora.load("x", cfg, _adapter(dec, 1), "t")
        dec.lora.load("y", cfg, _adapter(dec, 2), "t")
        sched = Scheduler(dec, 16, 8192, cuda_graph=graphs)
        sp = SamplingParams(max_new_tokens=12, temperature=0.0)
        reqs = [
            Request(str(i), PROMPT[i:], sp, 0, frozenset(), lora=name)
            for i, name in enumerate(["x", "y", None] * 2)
        ]
        for r in reqs:
            sched.submit(r)
        sched.run_until_idle()
        outputs.append([r.output for r in reqs])
    assert outputs[0] == outputs[1]
    assert outputs[0][0] != outputs[0][2]  # the adapter changes what is generated


def _logprobs(dec: Decoder, lora_slot: int | None) -> torch.Tensor:
    n, dev = len(PROMPT), dec.device
    ar = torch.arange(n, device=dev)
    slots = None if lora_slot is None else torch.full((n,), lora_slot, dtype=torch.int64, device=dev)
    batch = Batch(input_ids=torch.tensor(PROMPT, device=dev), positions=ar, write_slots=ar + 1,
                  query_index=ar[None], query_pos=ar[None], context_slots=(ar + 1)[None], last_index=ar,
                  lora_slots=slots)  # fmt: skip
    return torch.log_softmax(dec.forward(batch, dec.new_kv_pool(n + 1)), -1).float().cpu()


def test_adapter_logprobs_match_merged_weights(model):
    """The bf16 CUDA engine with an unmerged adapter against an fp32 CPU decoder holding W + s B A: no
    further from it than the bf16 engine without adapter is from the fp32 base model (plus 1e-2)."""
    dec = _decoder(model)
    tensors = _adapter(dec, 3)
    dec.lora.load("x", AdapterConfig(RANK, 16.0, TARGETS), tensors, "t")
    base, merged = load_weights(model), {}
    for name, w in base.items():
        module = name.removesuffix(".weight")
        a = tensors.get(f"base_model.model.{module}.lora_A.weight")
        if a is not None:
            w = w + 2.0 * (tensors[f"base_model.model.{module}.lora_B.weight"].float() @ a.float())
        merged[name] = w
    spec = ModelSpec.from_dir(model)
    want = _logprobs(Decoder(spec, merged, "cpu", torch.float32), None)
    plain = _logprobs(Decoder(spec, base, "cpu", torch.float32), None)
    err = float((_logprobs(dec, 0) - want).abs().max())
    noise = float((_logprobs(dec, None) - plain).abs().max())
    print(f"LoRA bf16 unmerged vs fp32 merged max |log-prob diff| {err:.2e}; base bf16 vs fp32 {noise:.2e}")
    assert err <= 2 * noise + 1e-2
    assert float((want - plain).abs().max()) > 10 * (2 * noise + 1e-2)  # the adapter matters


def test_stacked_adapters_follow_the_weights_through_offload(model):
    """Where the kernel fits, the bank's A lies under the weight it adapts (one GEMM for both). Offload
    frees that memory too, an adapter loaded while the weights are on the host is served once they are
    back, and log-probs are unchanged by the round trip."""
    dec = _decoder(model)
    # o, gate/up and down stack their A; q/k/v only where k/v's rows fit the kernel's 128-column blocks
    assert {"model.layers.0.self_attn.o_proj", "model.layers.0.mlp.gate_up_proj"} <= dec.lora.stacked
    fits = dec.spec.num_kv_heads * dec.spec.head_dim % 128 == 0
    assert ("model.layers.0.self_attn.qkv_proj" in dec.lora.stacked) == fits
    cfg = AdapterConfig(RANK, 16.0, TARGETS)
    dec.lora.load("x", cfg, _adapter(dec, 1), "t")
    before = _logprobs(dec, 0)
    weights = sum(t.numel() * t.element_size() for t in dec._owners().values())
    held = torch.cuda.memory_allocated()
    dec.offload()
    freed = held - torch.cuda.memory_allocated()
    assert freed >= weights, (freed, weights)
    dec.lora.load("y", cfg, _adapter(dec, 2), "t")
    dec.onload()
    assert torch.equal(_logprobs(dec, 0), before)
    fresh = _decoder(model)
    fresh.lora.load("x", cfg, _adapter(fresh, 1), "t")
    fresh.lora.load("y", cfg, _adapter(fresh, 2), "t")
    assert torch.equal(_logprobs(dec, 1), _logprobs(fresh, 1))
    assert not torch.equal(_logprobs(dec, 1), before)
