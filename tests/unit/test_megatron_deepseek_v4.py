"""DeepSeek-V4's mixture of experts as Megatron modules (miles/train/megatron/deepseek_v4_moe.py):
megatron-core's MoE layer with the sqrtsoftplus router or the hash router, experts and shared expert
clamped by `swiglu_limit`, loaded from transformers' `DeepseekV4SparseMoeBlock` weights, gives that
block's output on the same hidden states and token ids (fp32, CPU), with scores large enough that the
clamp acts; replaying other experts through the learned router changes the output as transformers'
replay does, and a hash layer follows its table whatever its scores."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core")


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from miles.models.tiny import init_tiny

    path = init_tiny(tmp_path_factory.mktemp("v4") / "m", arch="deepseek_v4", seed=1)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture
def one_rank():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    saved = torch.cuda.current_device
    if not torch.cuda.is_available():  # megatron-core's layers ask torch.cuda for their device
        torch.cuda.current_device = lambda: torch.device("cpu")
    yield
    torch.cuda.current_device = saved
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def _moe_layer(cfg, hashed: bool, limit: float):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from miles.train.megatron import deepseek_v4_moe as V4
    from miles.train.megatron.model import _moe_utils_without_te

    _moe_utils_without_te()
    tf = TransformerConfig(
        num_layers=1, hidden_size=cfg.hidden_size, num_attention_heads=4, ffn_hidden_size=cfg.intermediate_size,
        num_moe_experts=cfg.n_routed_experts, moe_router_topk=cfg.num_experts_per_tok,
        moe_ffn_hidden_size=cfg.moe_intermediate_size,
        moe_shared_expert_intermediate_size=cfg.moe_intermediate_size * cfg.n_shared_experts,
        moe_router_score_function="sigmoid",
        moe_router_topk_scaling_factor=float(cfg.routed_scaling_factor), moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="allgather", moe_enable_routing_replay=not hashed,
        gated_linear_unit=True, activation_func=F.silu, activation_func_clamp_value=limit,
        add_bias_linear=False, use_cpu_initialization=True, params_dtype=torch.float32, hidden_dropout=0.0,
        bias_activation_fusion=False,
    )  # fmt: skip
    router = V4.hash_router(cfg.vocab_size) if hashed else V4.SqrtSoftplusRouter
    return V4.build_moe(router, tf, 1)


def _load(layer, block) -> None:
    own = dict(layer.named_parameters()) | dict(layer.named_buffers())
    want = {"router.weight": block.gate.weight}
    if hasattr(block.gate, "tid2eid"):
        want["router.tid2eid"] = block.gate.tid2eid
    else:
        want["router.expert_bias"] = block.gate.e_score_correction_bias
    for e in range(block.experts.num_experts):
        want[f"experts.local_experts.{e}.linear_fc1.weight"] = block.experts.gate_up_proj[e]
        want[f"experts.local_experts.{e}.linear_fc2.weight"] = block.experts.down_proj[e]
    s = block.shared_experts
    want["shared_experts.linear_fc1.weight"] = torch.cat([s.gate_proj.weight, s.up_proj.weight])
    want["shared_experts.linear_fc2.weight"] = s.down_proj.weight
    with torch.no_grad():
        for name, t in want.items():
            own[name].copy_(t)


@pytest.mark.parametrize("layer_index", [0, 1], ids=["hash", "learned"])
def test_the_moe_layer_equals_transformers(v4, one_rank, layer_index):
    from miles.train.megatron import deepseek_v4_moe as V4

    cfg = v4.config
    block = v4.model.layers[layer_index].mlp
    hashed = cfg.mlp_layer_types[layer_index] == "hash_moe"
    assert hashed == (layer_index == 0)
    limit = 0.5  # the tiny model's weights are small: a low limit makes the clamp act (real V4: 10)
    block.experts.limit = block.shared_experts.limit = limit
    layer = _moe_layer(cfg, hashed, limit)
    _load(layer, block)
    with torch.no_grad():
        block.gate.e_score_correction_bias.normal_(0, 0.5) if not hashed else None
        layer.router.expert_bias.copy_(block.gate.e_score_correction_bias) if not hashed else None
    g = torch.Generator().manual_seed(0)
    s, b = 9, 2
    hidden = torch.randn(b, s, cfg.hidden_size, generator=g) * 4.0
    ids = torch.randint(3, cfg.vocab_size, (b, s), generator=g)
    with torch.no_grad():
        want = block(hidden, input_ids=ids)
        if hashed:
            layer.router.tokens = V4.TokenIds()
            layer.router.tokens.ids = ids.t().reshape(-1)
        got, _ = layer(hidden.transpose(0, 1).contiguous())
    assert (got.transpose(0, 1) - want).abs().max().item() <= 1e-5
    gate = F.linear(hidden, block.experts.gate_up_proj[0]).chunk(2, -1)[0]
    assert (gate > limit).any() and (gate < limit).any()  # the clamp was exercised


def test_replaying_experts_through_the_learned_router(v4, one_rank):
    """megatron-core's RouterReplay through SqrtSoftplusRouter: other experts than the router's own are
    used, weighted by the router's own scores at them (normalised, scaled), as transformers' block
    gives with those experts forced."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    cfg = v4.config
    block = v4.model.layers[1].mlp
    block.experts.limit = block.shared_experts.limit = 0.5  # as in the test above, whichever runs first
    layer = _moe_layer(cfg, hashed=False, limit=0.5)
    _load(layer, block)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 5, cfg.hidden_size, generator=g)
    flat = hidden.reshape(-1, cfg.hidden_size)
    k, n = cfg.num_experts_per_tok, cfg.n_routed_experts
    given = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(flat.shape[0])])
    with torch.no_grad():
        natural = block(hidden)
        scores = torch.sqrt(F.softplus(F.linear(flat, block.gate.weight)))
        w = scores.gather(1, given)
        w = w / (w.sum(-1, keepdim=True) + 1e-20) * cfg.routed_scaling_factor
        want = block.experts(flat, given, w).view_as(hidden) + block.shared_experts(hidden)
        rr = layer.router.router_replay
        order = given.view(2, 5, k).transpose(0, 1).reshape(-1, k)  # the router's position-major order
        rr.set_target_indices(order)
        rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        got, _ = layer(hidden.transpose(0, 1).contiguous())
    assert (want - natural).abs().max().item() > 1e-3
    assert (got.transpose(0, 1) - want).abs().max().item() <= 1e-5


def test_hyper_connections_equal_transformers(v4, one_rank):
    """mHC as Megatron modules (miles/train/megatron/deepseek_v4_hc.py), loaded from a transformers
    decoder layer: the collapsed block inputs, the streams after each block (given the blocks' own
    outputs) and the final head equal transformers' (fp32); the post-mix applied to the block's input
    instead of its output (the bug AMD's alignment found) does not."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from miles.train.megatron.deepseek_v4_hc import HyperConnection, HyperHead, mix

    cfg = v4.config
    tf = TransformerConfig(num_layers=1, hidden_size=cfg.hidden_size, num_attention_heads=4,
                           use_cpu_initialization=True)  # fmt: skip
    layer = v4.model.layers[1]
    hc = {n: HyperConnection(tf, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
          for n in ("attn_hc", "ffn_hc")}  # fmt: skip
    head = HyperHead(tf, cfg.hc_mult, cfg.hc_eps, cfg.rms_norm_eps)
    with torch.no_grad():
        for n, m in hc.items():
            m.load_state_dict(getattr(layer, n).state_dict())
        head.load_state_dict(v4.model.hc_head.state_dict())
    seen = {}
    hooks = [
        layer.self_attn.register_forward_hook(lambda _m, _a, out: seen.__setitem__("attn", out[0])),
        layer.mlp.register_forward_hook(lambda _m, _a, out: seen.__setitem__("mlp", out)),
        layer.register_forward_hook(lambda _m, args, kw, out: seen.update(streams=args[0] if args else kw["hidden_states"], out=out), with_kwargs=True),
        v4.model.hc_head.register_forward_hook(lambda _m, args, out: seen.update(head_in=args[0], head_out=out)),
    ]  # fmt: skip
    ids = torch.randint(3, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        v4(ids)
        for h in hooks:
            h.remove()
        streams = seen["streams"].transpose(0, 1)  # [s, b, N, D], Megatron's layout
        post, comb, collapsed = hc["attn_hc"](streams)
        assert torch.allclose(collapsed, layer.attn_hc(seen["streams"])[2].transpose(0, 1), atol=1e-6)
        mid = mix(post, comb, seen["attn"].transpose(0, 1), streams)
        post2, comb2, _ = hc["ffn_hc"](mid)
        out = mix(post2, comb2, seen["mlp"].transpose(0, 1), mid)
        assert (out.transpose(0, 1) - seen["out"]).abs().max().item() <= 1e-5  # the layer's own output
        wrong = mix(post, comb, collapsed, streams)  # the post-mix on the block's input, not its output
        wrong = mix(post2, comb2, seen["mlp"].transpose(0, 1), wrong)
        assert (wrong.transpose(0, 1) - seen["out"]).abs().max().item() > 1e-3
        assert torch.allclose(
            head(seen["head_in"].transpose(0, 1)).transpose(0, 1), seen["head_out"], atol=1e-6
        )


@pytest.mark.parametrize("layer_index", [0, 1, 2], ids=["sliding", "csa", "hca"])
def test_hybrid_attention_equals_transformers(v4, one_rank, layer_index):
    """DeepSeek-V4's attention as a Megatron module (miles/train/megatron/deepseek_v4_attention.py),
    loaded from a transformers layer's attention state: its output on the hidden states that attention
    saw inside transformers' forward equals transformers' (fp32), over 30 tokens (sliding window 8,
    CSA windows of 4 with the indexer's top 4, HCA windows of 8)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from miles.engine.v4_spec import V4Spec
    from miles.train.megatron.deepseek_v4_attention import HybridAttention

    cfg = v4.config
    spec = V4Spec.from_config(cfg.to_dict())
    tf = TransformerConfig(num_layers=1, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                           use_cpu_initialization=True)  # fmt: skip
    hf_attn = v4.model.layers[layer_index].self_attn
    ours = HybridAttention(tf, spec, layer_index)
    missing, unexpected = ours.load_state_dict(hf_attn.state_dict(), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    seen = {}
    hook = hf_attn.register_forward_hook(
        lambda _m, args, kw, out: seen.update(
            h=kw.get("hidden_states", args[0] if args else None), out=out[0]
        ),
        with_kwargs=True,
    )
    ids = torch.randint(3, cfg.vocab_size, (2, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        v4(ids)
        hook.remove()
        got = ours(seen["h"].transpose(0, 1)).transpose(0, 1)
    assert (got - seen["out"]).abs().max().item() <= 1e-5


def test_the_whole_model_equals_transformers_and_exports_byte_identical(v4, one_rank, tmp_path):
    """DeepSeek-V4 of Megatron modules (miles/train/megatron/deepseek_v4_model.py) loaded from the tiny
    checkpoint (DeepSeek's spelling) gives transformers' logits (fp32) on 37 tokens, and its state
    converted back is the checkpoint, tensor for tensor and name for name."""
    from miles.train.megatron import deepseek_v4_model as V4
    from miles.train.megatron.model import _moe_utils_without_te, read_hf_state

    _moe_utils_without_te()
    cfg = v4.config
    for layer in v4.model.layers:  # the other tests lower the clamp of these modules: the model's own
        layer.mlp.experts.limit = layer.mlp.shared_experts.limit = cfg.swiglu_limit
    path = tmp_path / "m"
    v4.save_pretrained(path)
    ckpt = read_hf_state(str(path))
    model = V4.DeepseekV4GPT(cfg, V4.transformer_config(cfg, torch.float32, use_cpu=True,
                                                        extra={"moe_token_dispatcher_type": "allgather", "variable_seq_lengths": False}))  # fmt: skip
    state = V4.to_megatron(ckpt)
    own = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    assert sorted(state) == sorted(own)
    model.load_state_dict(state, strict=False)
    back = V4.to_checkpoint({k: v for k, v in model.state_dict().items() if k in own}, list(ckpt))
    assert back.keys() == ckpt.keys() and all(torch.equal(back[k], ckpt[k]) for k in ckpt)
    ids = torch.randint(3, cfg.vocab_size, (2, 37), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = v4(ids).logits
        got = model.eval()(ids)
    assert (got - want).abs().max().item() <= 1e-4


def test_the_alignment_tool_names_amds_two_bugs(tmp_path):
    """`miles align --backend megatron` on DeepSeek-V4 (Miles' Megatron modules): equal to the engine
    module by module; a hash table that differs from the engine's is named at the hash layer's MoE,
    and a post-mix applied to the attention's input instead of its output at the hyper-connection
    that reads the streams it mixed."""
    from miles.align import align
    from miles.models.tiny import init_tiny
    from miles.train.megatron.deepseek_v4_hc import mix

    path = str(init_tiny(tmp_path / "v4", arch="deepseek_v4", seed=1))
    prompts = [[5, 17, 40, 99, 12, 7, 8, 9, 10], [7, 8, 9, 10, 11, 12, 13, 30, 31, 32]]
    clean = align(path, prompts, max_new=8, backend="megatron")
    assert clean.summary()["max"] <= 1e-4 and clean.first_divergent is None, clean.modules

    def table(_decoder, model):
        router = model.layers["0"].mlp.router  # every token's experts shifted by one
        router.tid2eid.copy_((router.tid2eid + 1) % router.config.num_moe_experts)

    assert (
        align(path, prompts, max_new=8, backend="megatron", patch=table).first_divergent
        == "model.layers.0.mlp"
    )

    def post_mix_first(_decoder, model):
        layer = model.layers["1"]

        def forward(streams):
            post, comb, x = layer.attn_hc(streams)
            streams = mix(post, comb, x, streams)  # the bug: post-mix on the block's input
            layer.self_attn(layer.input_layernorm(x))
            post, comb, x = layer.ffn_hc(streams)
            out, _ = layer.mlp(layer.post_attention_layernorm(x))
            return mix(post, comb, out, streams)

        layer.forward = forward

    found = align(path, prompts, max_new=8, backend="megatron", patch=post_mix_first).first_divergent
    assert found == "model.layers.1.ffn_hc"
