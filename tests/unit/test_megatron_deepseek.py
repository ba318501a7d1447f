"""DeepSeek-V3 on Megatron (latent attention, DeepSeek's router with its correction bias and expert
groups, a shared expert, a dense first layer): real megatron-core layers on the CPU, loaded from
transformers' weights, give transformers' logits (fp32, 1e-4), export back byte-identical, and
`miles align --backend megatron` finds them equal to the engine module by module and names a planted
router bug. Configs megatron-core's router cannot mirror are refused."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from miles.config import ConfigError

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core")
CPU = {"moe_token_dispatcher_type": "allgather", "variable_seq_lengths": False}
"""megatron-core's all-to-all dispatcher opens a CUDA stream; the CPU tests take the all-gather one."""


@pytest.fixture(scope="module")
def v3(tmp_path_factory) -> str:
    from miles.models.tiny import init_tiny

    return str(init_tiny(tmp_path_factory.mktemp("v3") / "m", arch="deepseek_v3", seed=1))


@pytest.fixture
def one_rank():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    saved = torch.cuda.current_device
    if not torch.cuda.is_available():  # megatron-core's rotary table asks torch.cuda for its device
        torch.cuda.current_device = lambda: torch.device("cpu")
    yield
    torch.cuda.current_device = saved
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def test_logits_equal_transformers_and_export_is_byte_identical(v3, one_rank):
    from transformers import AutoConfig, AutoModelForCausalLM

    from miles.train.megatron import convert
    from miles.train.megatron import model as M

    cfg = AutoConfig.from_pretrained(v3)
    gpt = M.build_gpt(cfg, M.transformer_config(cfg, torch.float32, 1, 1, use_cpu=True, extra=CPU))
    hf = M.read_hf_state(v3)
    M.load_hf_into(gpt, hf, cfg)
    names = {n for n in gpt.state_dict() if "layers.1." in n}
    assert {"decoder.layers.1.self_attention.linear_kv_up_proj.weight", "decoder.layers.1.mlp.router.expert_bias",
            "decoder.layers.1.mlp.shared_experts.linear_fc1.weight"} <= names  # fmt: skip
    back = convert.megatron_to_hf(
        {k: v for k, v in gpt.state_dict().items() if not k.endswith("_extra_state")}, M.shapes_of(cfg)
    )
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)
    ids = torch.randint(3, 380, (1, 37), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(v3, dtype=torch.float32).eval()(ids).logits[0]
        gpt.eval()
        out = gpt(ids, torch.arange(37)[None], None)[0]
    assert (out - ref).abs().max().item() <= 1e-4


def test_the_alignment_tool_finds_megatron_equal_to_the_engine_and_names_a_bug(v3):
    from miles.align import align

    prompts = [[5, 17, 40, 99, 12], [7, 8, 9, 10, 11, 12, 13]]
    clean = align(v3, prompts, max_new=8, backend="megatron")
    assert clean.summary()["max"] <= 1e-4 and clean.first_divergent is None

    def patch(_decoder, gpt):
        gpt.decoder.layers[2].mlp.router.expert_bias.copy_(torch.arange(8.0).flip(0))

    assert (
        align(v3, prompts, max_new=8, backend="megatron", patch=patch).first_divergent == "model.layers.2.mlp"
    )


def test_a_group_rule_megatron_core_cannot_mirror_is_refused(v3):
    from transformers import AutoConfig

    from miles.train.megatron import moe

    cfg = AutoConfig.from_pretrained(v3)
    cfg.num_experts_per_tok = 3
    with pytest.raises(ConfigError, match="num_experts_per_tok = 2 x topk_group: use train.backend=fsdp"):
        moe.check(cfg)


def test_routing_replay_through_megatrons_router_equals_transformers(v3, one_rank):
    """R3 on Megatron's DeepSeek router (sigmoid scores, correction bias, expert groups): replaying the
    rollout's experts gives the logits transformers gives replaying the same experts (the FSDP path's
    patched routers), away from the router's own choice; the metrics say the rows were used and that
    the router alone would have chosen otherwise."""
    import numpy as np
    from transformers import AutoConfig, AutoModelForCausalLM

    from miles.sample import Sample
    from miles.train.megatron import model as M
    from miles.train.megatron.moe import MoERouting
    from miles.train.routing_replay import RoutingReplay, find_routers, packed_routing

    cfg = AutoConfig.from_pretrained(v3)
    gpt = M.build_gpt(cfg, M.transformer_config(cfg, torch.float32, 1, 1, use_cpu=True, extra=CPU))
    M.load_hf_into(gpt, M.read_hf_state(v3), cfg)
    gpt.eval()
    tokens = np.random.default_rng(0).integers(3, 380, 30).tolist()
    ids = torch.tensor([tokens])
    hf = AutoModelForCausalLM.from_pretrained(v3, dtype=torch.float32).eval()
    rr = RoutingReplay.install(hf, replay=True)
    n_routers, k, experts = len(find_routers(hf)), cfg.num_experts_per_tok, cfg.n_routed_experts
    rng = np.random.default_rng(1)
    other = np.stack([rng.permutation(experts)[:k] for _ in range((len(tokens) - 1) * n_routers)])
    sample = Sample(0, 0, tokens[:20], tokens[20:])
    sample.routed_experts = other.reshape(len(tokens) - 1, n_routers * k).astype(np.uint8)
    with torch.no_grad():
        own = gpt(ids, torch.arange(len(tokens))[None], None)[0]
        with rr.batch(packed_routing([sample], [0], rr.shape, required=True), measure=False):
            want = hf(ids, use_cache=False).logits[0]
        routing = MoERouting(gpt, cfg, 0, replay=True)
        routing.measure = True
        mb = SimpleNamespace(tokens=ids, sample_ids=[0])
        with routing.micro_batch([sample], mb):
            got = gpt(ids, torch.arange(len(tokens))[None], None)[0]
    assert (got - own).abs().max().item() > 1e-2  # the replayed experts are not the router's own
    assert (got - want).abs().max().item() <= 1e-4
    stats = routing.stats.metrics(routing.stats.stats())
    assert stats["router_agreement"] == 1.0  # the experts used are the rows'
    assert stats["router_natural_agreement"] < 0.5  # the router alone would have chosen others


def _with_mtp(hf: dict[str, torch.Tensor], layers: int, hidden: int) -> dict[str, torch.Tensor]:
    """`hf` plus one multi-token-prediction layer as DeepSeek-V3's checkpoint holds it (layer L): a copy
    of the last (sparse) decoder layer, its own norms and projection, and copies of the embedding
    and head."""
    g = torch.Generator().manual_seed(3)
    last, mtp = f"model.layers.{layers - 1}.", f"model.layers.{layers}."
    out = dict(hf) | {mtp + k.removeprefix(last): v.clone() for k, v in hf.items() if k.startswith(last)}
    for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
        out[mtp + name] = torch.rand(hidden, generator=g) + 0.5
    out[mtp + "eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=g) * 0.02
    out[mtp + "embed_tokens.weight"] = hf["model.embed_tokens.weight"].clone()
    out[mtp + "shared_head.head.weight"] = hf["lm_head.weight"].clone()
    return out


def test_mtp_layers_convert_to_megatron_cores_mtp_block_and_back_byte_identical(v3, one_rank):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
    from transformers import AutoConfig

    from miles.train.megatron import convert
    from miles.train.megatron import model as M

    cfg = AutoConfig.from_pretrained(v3)
    s = M.shapes_of(cfg)
    hf = _with_mtp(M.read_hf_state(v3), cfg.num_hidden_layers, cfg.hidden_size)
    full = convert.hf_to_megatron(hf, s)
    tf = M.transformer_config(cfg, torch.float32, 1, 1, use_cpu=True, extra=CPU | {"mtp_num_layers": 1})
    spec = M.layer_spec(tf)
    mtp = get_gpt_mtp_block_spec(tf, spec.layer_specs[-1], use_transformer_engine=False)
    gpt = GPTModel(config=tf, transformer_layer_spec=spec, vocab_size=cfg.vocab_size, max_sequence_length=64,
                   mtp_block_spec=mtp, position_embedding_type="rope")  # fmt: skip
    own = {k for k in gpt.state_dict() if not k.endswith("_extra_state")}
    assert {k for k in full if k.startswith("mtp.")} == {k for k in own if k.startswith("mtp.")}
    gpt.load_state_dict(full, strict=False)
    state = {k: v for k, v in gpt.state_dict().items() if k in full}
    back = convert.megatron_to_hf(state, s)
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[k], hf[k]) for k in hf), [k for k in hf if not torch.equal(back[k], hf[k])][
        :3
    ]
    assert convert.mtp_layers(hf, s) == 1 and convert.mtp_layers(M.read_hf_state(v3), s) == 0
    hf[f"model.layers.{cfg.num_hidden_layers}.shared_head.head.weight"] += 1
    with pytest.raises(ValueError, match="shared_head.head.weight differs from lm_head.weight"):
        convert.hf_to_megatron(hf, s)
