"""The engine's Qwen3-MoE family against transformers' Qwen3MoeForCausalLM on the same tiny weights:
logits of prompts and decode steps (fp32, <= 1e-4), the router's top-k per token and layer, the
expert paths agreeing, and both weight layouts (per-expert and stacked) loading."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from miles.engine import moe
from miles.engine.model import Batch, Decoder, ModelSpec, load_weights
from miles.engine.sampling import SamplingParams
from miles.engine.scheduler import Request, Scheduler


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> str:
    from miles.models.tiny import init_tiny

    return str(init_tiny(tmp_path_factory.mktemp("models") / "tiny-moe", arch="qwen3_moe", seed=0))


@pytest.fixture(scope="module")
def hf_moe(moe_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(moe_model, dtype=torch.float32).eval()


def _prefill(tokens: list[int]) -> Batch:
    n = len(tokens)
    ar = torch.arange(n)
    return Batch(
        input_ids=torch.tensor(tokens),
        positions=ar,
        write_slots=ar + 1,
        query_index=ar[None],
        query_pos=ar[None],
        context_slots=(ar + 1)[None],
        last_index=torch.tensor([n - 1]),
    )


def _hf_topk(hf, tokens: list[int]) -> torch.Tensor:
    """[T, sparse layers, k] expert ids of transformers' router (from its router logits)."""
    cfg = hf.config
    with torch.no_grad():
        out = hf(torch.tensor([tokens]), output_router_logits=True)
    per_layer = [
        torch.softmax(g.float(), -1).topk(cfg.num_experts_per_tok, -1).indices for g in out.router_logits
    ]
    return torch.stack(per_layer, dim=1)


def test_spec_reads_the_moe_config(moe_model):
    spec = ModelSpec.from_dir(moe_model)
    assert spec.arch == "Qwen3MoeForCausalLM"
    assert spec.moe == moe.MoeSpec(4, 2, 32, True, (1,))
    assert spec.moe.record_dtype() == torch.uint8


def test_prompt_logits_and_routing_match_transformers(moe_model, hf_moe):
    spec = ModelSpec.from_dir(moe_model)
    dec = Decoder(spec, load_weights(moe_model), "cpu", torch.float32)
    dec.record_routing = True
    tokens = [random.Random(1).randrange(4, 380) for _ in range(23)]
    logits = dec.forward(_prefill(tokens), dec.new_kv_pool(64))
    with torch.no_grad():
        ref = hf_moe(torch.tensor([tokens])).logits[0, -1].float()
    assert (logits[0] - ref).abs().max().item() <= 1e-4
    assert dec.routing.shape == (len(tokens), 1, 2) and dec.routing.dtype == torch.uint8
    assert torch.equal(dec.routing.long(), _hf_topk(hf_moe, tokens))


@pytest.mark.parametrize("overlap", [False, True], ids=["in_step", "overlap"])
def test_decode_logprobs_match_transformers(moe_model, hf_moe, overlap):
    """Greedy decode through the scheduler (prefill, then CPU row decode): every step's log-prob
    equals transformers' full forward over prompt + output."""
    spec = ModelSpec.from_dir(moe_model)
    sched = Scheduler(Decoder(spec, load_weights(moe_model), "cpu", torch.float32), 8, 1024, overlap=overlap)
    thread = threading.Thread(target=sched.run, daemon=True)
    thread.start()
    try:
        rng = random.Random(2)
        reqs = []
        for i in range(3):
            sp = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
            prompt = [rng.randrange(4, 380) for _ in range(5 + 7 * i)]
            reqs.append(Request(rid=str(i), prompt=prompt, params=sp, seed=i, stop_ids=frozenset()))
            sched.submit(reqs[-1])
        done = [r.done.result(timeout=120) for r in reqs]
    finally:
        sched.stop()
        thread.join(timeout=10)
    for r in done:
        with torch.no_grad():
            logp = hf_moe(torch.tensor([r.prompt + r.output])).logits[0].float().log_softmax(-1)
        n = len(r.prompt)
        assert r.output == logp[n - 1 : -1].argmax(-1).tolist()
        ref = torch.stack([logp[n - 1 + j, t] for j, t in enumerate(r.output)])
        assert (ref - torch.tensor(r.logprobs)).abs().max().item() <= 1e-4


def test_expert_paths_agree():
    """The looped, grouped (torch._grouped_mm, run on CPU tensors) and gathered paths give one sum,
    including experts that no token chose."""
    g = torch.Generator().manual_seed(0)
    T, H, inter, E, k = 11, 16, 8, 6, 2
    x = torch.randn(T, H, generator=g)
    gate = torch.randn(E, H, generator=g)
    gate_up, down = torch.randn(E, 2 * inter, H, generator=g), torch.randn(E, H, inter, generator=g)
    weights, ids = moe.route(x, gate, k, True)
    ids[:, :] = torch.where(ids == 5, 4, ids)  # expert 5 unused, expert 4 possibly twice per token
    ids[:, 1] = torch.where(ids[:, 0] == ids[:, 1], (ids[:, 0] + 1) % 5, ids[:, 1])
    ref = torch.zeros(T, H)
    for t in range(T):
        for s in range(k):
            e = ids[t, s]
            a, b = (gate_up[e] @ x[t]).chunk(2)
            ref[t] += weights[t, s] * (down[e] @ (torch.nn.functional.silu(a) * b))
    paths = [moe.experts_looped, moe.experts_gathered]
    if hasattr(torch, "_grouped_mm"):
        paths.append(moe.experts_grouped)
    for path in paths:
        assert (path(x, ids, weights, gate_up, down) - ref).abs().max().item() <= 1e-4, path.__name__


def test_stacked_expert_tensors_load_as_per_expert_views(moe_model, hf_moe):
    """transformers' in-memory names (`mlp.experts.gate_up_proj` [E, 2I, H]) load into the engine and
    give the same weights as the per-expert checkpoint; a wrong expert count is refused by name."""
    spec = ModelSpec.from_dir(moe_model)
    dec = Decoder(spec, load_weights(moe_model), "cpu", torch.float32)
    state = {n: t.detach() for n, t in hf_moe.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    stacked = {n: t * 2 for n, t in state.items() if ".experts." in n}
    dec.load(stacked)
    want = state["model.layers.1.mlp.experts.gate_up_proj"][3, 32:] * 2
    assert torch.equal(dec.params["model.layers.1.mlp.experts.3.up_proj.weight"], want)
    with pytest.raises(ValueError, match="num_experts=4"):
        dec.load({"model.layers.1.mlp.experts.down_proj": torch.zeros(3, 64, 32)})


def test_moe_spec_from_published_config_keys():
    """`num_experts` (published checkpoints), `decoder_sparse_step` and `mlp_only_layers` pick the sparse
    layers; a config without experts or with a shared expert is refused by key."""
    cfg = dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True)
    assert moe.MoeSpec.from_config({**cfg, "decoder_sparse_step": 2}, 6).sparse_layers == (1, 3, 5)
    assert moe.MoeSpec.from_config({**cfg, "mlp_only_layers": [0, 2]}, 4).sparse_layers == (1, 3)
    assert moe.MoeSpec.from_config({**cfg, "num_experts": 300}, 2).record_dtype() == torch.int16
    with pytest.raises(ValueError, match="num_experts"):
        moe.MoeSpec.from_config({**cfg, "num_experts": 0}, 2)
    with pytest.raises(ValueError, match="shared_expert_intermediate_size"):
        moe.MoeSpec.from_config({**cfg, "shared_expert_intermediate_size": 512}, 2)


def test_without_recording_nothing_is_kept(moe_model):
    dec = Decoder(ModelSpec.from_dir(moe_model), load_weights(moe_model), "cpu", torch.float32)
    pool = dec.new_kv_pool(64)
    dec.forward(_prefill([5, 6, 7]), pool)
    assert dec.routing is None and dec.routing_table is None
