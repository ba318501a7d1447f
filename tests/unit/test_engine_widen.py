"""`Decoder.widen` (miles/engine/model.py): zero rows stacked under a stored weight, where the LoRA
bank keeps a layer's A so that one GEMM yields x W^T and x A^T. The weights (and what the model
computes) do not change, the stored tensor and its HF-named views alias the wider one, weight updates
land in it, and the stacked rows go to host memory and back with the weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from miles.engine.model import Batch, Decoder, ModelSpec, load_weights

PROMPT = list(range(3, 40, 2))
QKV = "model.layers.0.self_attn.qkv_proj"


def peft_tensors(bank, rank: int, gen: torch.Generator, std: float) -> dict[str, torch.Tensor]:
    """A random adapter of `rank` on every module of `bank` but the LM head, under PEFT's saved names."""
    out = {}
    for m, (o, i) in bank.modules.items():
        if m != "lm_head":
            out[f"base_model.model.{m}.lora_A.weight"] = torch.randn(rank, i, generator=gen) * std
            out[f"base_model.model.{m}.lora_B.weight"] = torch.randn(o, rank, generator=gen) * std
    return out


def _logits(dec: Decoder) -> torch.Tensor:
    n = len(PROMPT)
    ar = torch.arange(n)
    batch = Batch(input_ids=torch.tensor(PROMPT), positions=ar, write_slots=ar + 1, query_index=ar[None],
                  query_pos=ar[None], context_slots=(ar + 1)[None], last_index=ar)  # fmt: skip
    return dec.forward(batch, dec.new_kv_pool(n + 1))


def test_widened_weights_compute_the_same_and_travel_with_offload(tiny_model):
    weights = load_weights(tiny_model)
    dec = Decoder(ModelSpec.from_dir(tiny_model), weights, "cpu", torch.float32)
    before = _logits(dec)
    q = dec.get("model.layers.0.self_attn.q_proj.weight").clone()
    rows = dec.widen(QKV + ".weight", 8)
    assert rows is not None and rows.shape == (8, q.shape[1]) and not rows.any()
    wide, stored = dec.wide[QKV + ".weight"], dec.storage[QKV + ".weight"]
    assert stored.data_ptr() == wide.data_ptr() and wide.shape[0] == stored.shape[0] + 8
    assert dec.get("model.layers.0.self_attn.q_proj.weight").data_ptr() == wide.data_ptr()
    assert torch.equal(dec.get("model.layers.0.self_attn.q_proj.weight"), q)
    bias = dec.wide[QKV + ".bias"]  # qwen2 has q/k/v biases: zeros under them
    assert bias.shape[0] == stored.shape[0] + 8 and not bias[stored.shape[0] :].any()
    assert torch.equal(_logits(dec), before)

    rows.copy_(torch.randn(rows.shape, generator=torch.Generator().manual_seed(0)))
    x = torch.randn(5, q.shape[1], generator=torch.Generator().manual_seed(1))
    both = F.linear(x, wide, bias)
    assert torch.allclose(both[:, : stored.shape[0]], F.linear(x, stored, dec.storage[QKV + ".bias"]))
    assert torch.allclose(both[:, stored.shape[0] :], x @ rows.t())

    a = rows.clone()
    dec.offload()
    assert not dec.resident and torch.equal(dec.stacked_rows(QKV + ".weight"), a)
    dec.onload()
    assert torch.equal(dec.stacked_rows(QKV + ".weight"), a)
    assert dec.storage[QKV + ".weight"].data_ptr() == dec.wide[QKV + ".weight"].data_ptr()
    assert torch.equal(_logits(dec), before)

    dec.load({"model.layers.0.self_attn.q_proj.weight": q * 2})  # a weight update lands in the wide tensor
    assert torch.equal(dec.wide[QKV + ".weight"][: q.shape[0]], q * 2)
    assert torch.equal(dec.stacked_rows(QKV + ".weight"), a)
    assert not torch.equal(_logits(dec), before)


def test_only_matrices_of_the_compute_dtype_widen(tiny_model):
    dec = Decoder(ModelSpec.from_dir(tiny_model), load_weights(tiny_model), "cpu", torch.float32)
    assert dec.widen("model.norm.weight", 8) is None  # not a matrix
    assert dec.widen("model.layers.0.self_attn.q_proj.weight", 8) is None  # a view into qkv_proj
    assert dec.widen("model.layers.0.self_attn.o_proj.weight", 8) is not None
    dec.offload()
    assert dec.widen("model.layers.0.mlp.down_proj.weight", 8) is None  # weights on the host


def test_the_bank_keeps_its_a_in_the_stacked_rows_through_offload(tiny_model, monkeypatch):
    """The bank's bookkeeping on the CPU: with column blocks for every layer (the CUDA kernel's, which
    the CPU has none of), `for_decoder` stacks each A under its weight in a padded block; the A the
    bank reads (then through the PyTorch path, blocks dropped) keeps its shape and values after the
    weights went to the host and back, and the adapter still changes the logits the same way."""
    from miles.engine import lora
    from miles.engine.lora import STACK_ALIGN, TARGETS, AdapterConfig, LoraBank

    def every_unit(modules, units, *_):  # blocks for every layer, as the CUDA kernel would take them
        return {k: torch.zeros(1) for k in units if k != "lm_head"}

    monkeypatch.setattr(lora, "kernel_blocks", every_unit)
    dec = Decoder(ModelSpec.from_dir(tiny_model), load_weights(tiny_model), "cpu", torch.float32)
    base = _logits(dec)
    rank, slots = 4, 2
    dec.lora = LoraBank.for_decoder(dec, slots, rank, TARGETS, 8, kernels=True)
    assert {QKV, "model.layers.0.self_attn.o_proj", "model.layers.0.mlp.gate_up_proj"} <= dec.lora.stacked
    assert dec.stacked_rows(QKV + ".weight").shape[0] == STACK_ALIGN  # 3 x 8 rows of A, padded
    tensors = peft_tensors(dec.lora, rank, torch.Generator().manual_seed(2), 0.1)
    dec.lora.load("x", AdapterConfig(rank, 8.0, TARGETS[:-1]), tensors, "t")
    dec.lora.terms.blocks = {}  # the PyTorch path, which reads A from the stacked rows

    def adapted() -> torch.Tensor:
        n = len(PROMPT)
        ar = torch.arange(n)
        batch = Batch(input_ids=torch.tensor(PROMPT), positions=ar, write_slots=ar + 1, query_index=ar[None],
                      query_pos=ar[None], context_slots=(ar + 1)[None], last_index=ar,
                      lora_slots=torch.zeros(n, dtype=torch.int64))  # fmt: skip
        return dec.forward(batch, dec.new_kv_pool(n + 1))

    before, stored = adapted(), {k: v.clone() for k, v in dec.lora.stored("x").items()}
    assert not torch.allclose(before, base)
    dec.offload()
    dec.onload()
    width = slots * rank
    assert all(a.shape[0] == width for a in dec.lora.A.values())
    assert dec.lora.A[QKV.replace("qkv", "q")].data_ptr() == dec.stacked_rows(QKV + ".weight").data_ptr()
    assert all(torch.equal(v, stored[k]) for k, v in dec.lora.stored("x").items())
    assert torch.equal(adapted(), before)


def test_a_loaded_bank_costs_base_requests_nothing(tiny_model, monkeypatch):
    """While no running request has an adapter, a decode or prefill batch names no slots and the forward
    runs the base model alone (no adapter GEMM, no mask; the CUDA graphs of that case have none either);
    a request with an adapter brings the slots back for the batches it is in."""
    from miles.engine.fp8_weights import DEFAULT_FP8_MIN_TOKENS, build_decoder
    from miles.engine.lora import TARGETS, AdapterConfig, LoraBank
    from miles.engine.sampling import SamplingParams
    from miles.engine.scheduler import Request, Scheduler

    def run(sched: Scheduler, adapters: list[str | None]) -> tuple[list[Request], list[bool]]:
        seen = []
        forward = sched.decoder.forward

        def spy(b, pool):
            seen.append(b.lora_slots is not None)
            return forward(b, pool)

        monkeypatch.setattr(sched.decoder, "forward", spy)
        reqs = [Request(str(i), [3 + i, 9, 17, 5], SamplingParams(max_new_tokens=6, temperature=0.0), 100 + i,
                        frozenset(), lora=name) for i, name in enumerate(adapters)]  # fmt: skip
        for r in reqs:
            sched.submit(r)
        sched.run_until_idle()
        return reqs, seen

    spec = ModelSpec.from_dir(tiny_model)
    build = lambda: build_decoder(spec, tiny_model, "cpu", torch.float32, "none", DEFAULT_FP8_MIN_TOKENS)  # noqa: E731
    plain, _ = run(Scheduler(build(), 8, 4096, overlap=False), [None, None])
    dec = build()
    dec.lora = LoraBank.for_decoder(dec, 8, 4, TARGETS, 8)
    dec.lora.load(
        "x",
        AdapterConfig(4, 8.0, TARGETS[:-1]),
        peft_tensors(dec.lora, 4, torch.Generator().manual_seed(3), 0.2),
        "t",
    )
    sched = Scheduler(dec, 8, 4096, overlap=False)
    base, seen = run(sched, [None, None])
    assert seen and not any(seen), "base-only batches name no adapter slots"
    assert [r.output for r in base] == [r.output for r in plain]
    assert [r.logprobs for r in base] == [r.logprobs for r in plain]
    mixed, seen = run(sched, [None, "x"])
    assert all(seen), "every batch with the adapter's request names the slots"
    assert mixed[0].output == plain[0].output and mixed[1].logprobs != plain[1].logprobs
    assert not dec.lora.requests.any_in_use
