"""DeepSeek-V4 (Flash and Pro): hybrid compressed attention, hyper-connections, hash-routed experts.

Per layer (transformers' DeepseekV4ForCausalLM is the reference): an attention of one of three kinds,
`sliding_attention` (a window of `sliding_window` tokens), `compressed_sparse_attention` (the window
plus the KV compressed `compress_rates[csa]`:1, a Lightning Indexer keeping `index_topk` compressed
entries per query) or `heavily_compressed_attention` (the window plus the KV compressed
`compress_rates[hca]`:1, attended densely), with one shared-KV head, attention sinks and a grouped
output projection (`o_groups`, `o_lora_rank`); `hc_mult` residual streams mixed by Sinkhorn-normalised
matrices (mHC) around each sublayer; MoE layers routed by a frozen token-id table (`hash_moe`, the
first layers) or by top-k of `sqrtsoftplus` scores (`moe`), a shared expert beside them and
`swiglu_limit` clipping the routed experts' activations. Checkpoints carry MTP layers
(`num_nextn_predict_layers`) that transformers does not instantiate.
"""

from __future__ import annotations

import re

from miles.models.families.base import Family

LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")


_TOP = {
    "embed.weight": "model.embed_tokens.weight",
    "embed_tokens.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
    "hc_head.hc_fn": "model.hc_head.hc_fn",
    "hc_head.hc_base": "model.hc_head.hc_base",
    "hc_head.hc_scale": "model.hc_head.hc_scale",
}
_COMPRESSOR = {
    "wkv.weight": "kv_proj.weight",
    "wgate.weight": "gate_proj.weight",
    "ape": "position_bias",
    "norm.weight": "kv_norm.weight",
}
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    **{f"hc_{s}_{leaf}": f"{s}_hc.{leaf}" for s in ("attn", "ffn") for leaf in ("fn", "base", "scale")},
    "attn.attn_sink": "self_attn.sinks",
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv.weight": "self_attn.kv_proj.weight",
    "attn.norm.weight": "self_attn.kv_norm.weight",
    "attn.wo_a.weight": "self_attn.o_a_proj.weight",
    "attn.wo_b.weight": "self_attn.o_b_proj.weight",
    **{f"attn.compressor.{a}": f"self_attn.compressor.{b}" for a, b in _COMPRESSOR.items()},
    **{f"attn.indexer.compressor.{a}": f"self_attn.compressor.indexer.{b}" for a, b in _COMPRESSOR.items()},
    "attn.indexer.wq_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
    "attn.indexer.weights_proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
    **{
        f"ffn.shared_experts.{w}.weight": f"mlp.shared_experts.{n}.weight"
        for w, n in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))
    },
}
_EXPERT = re.compile(r"ffn\.experts\.(\d+)\.(w[123])\.weight")
_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def hf_name(name: str) -> str | None:
    """transformers' in-memory name of a checkpoint tensor in DeepSeek's spelling (the spelling
    transformers writes; miles/models/deepseek_v4_layout.py lists it); in-memory names pass through;
    None for MTP layers (`mtp.*`), which the model does not hold."""
    bare = name.removeprefix("model.")
    if bare.startswith("mtp."):
        return None
    for suffix in (".weight_scale_inv", ".scale"):  # an FP8 weight's scale follows its weight's name
        if bare.endswith(suffix) and not bare.removesuffix(suffix).endswith(("_hc", "hc_head.hc", "hc_head")):
            weight = hf_name(name.removesuffix(suffix) + ".weight")
            return None if weight is None else weight + "_scale_inv"
    if bare in _TOP:
        return _TOP[bare]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", bare)
    if m is None:
        return name
    rest = m.group(2)
    if (e := _EXPERT.fullmatch(rest)) is not None:
        rest = f"mlp.experts.{e.group(1)}.{_PROJ[e.group(2)]}.weight"
    return f"model.layers.{m.group(1)}.{_LAYER.get(rest, rest)}"


def hf_names(weights: dict) -> dict:
    """`weights` under transformers' in-memory names (`hf_name`), MTP layers dropped."""
    out = {}
    for name, t in weights.items():
        if (new := hf_name(name)) is not None:
            out[new] = t
    return out


def _fill(model, seed: int) -> None:
    """What transformers' init leaves constant, drawn at random so a tiny model takes every path: each
    hash layer's token -> experts table (k distinct experts per token), the routers' correction biases,
    the attention sinks, the compressors' position biases and the hyper-connections' bases."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in [*model.named_buffers(), *model.named_parameters()]:
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "tid2eid":
                experts = model.config.n_routed_experts
                rows = [torch.randperm(experts, generator=gen)[: t.shape[1]] for _ in range(t.shape[0])]
                t.copy_(torch.stack(rows))
            elif leaf in ("e_score_correction_bias", "sinks", "position_bias", "base", "hc_base"):
                t.copy_(torch.randn(t.shape, generator=gen) * 0.1)


FAMILY = Family(
    hf_arch="DeepseekV4ForCausalLM",
    model_type="deepseek_v4",
    config_class="DeepseekV4Config",
    moe=True,
    attention="deepseek_v4",
    backends=("engine", "fsdp", "megatron"),
    packs=False,
    tiny=dict(
        num_hidden_layers=5,
        num_key_value_heads=1,
        head_dim=32,
        partial_rotary_factor=0.25,
        q_lora_rank=48,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=32,
        intermediate_size=32,  # transformers maps it to moe_intermediate_size
        routed_scaling_factor=1.5,
        layer_types=[LAYER_TYPES[0], LAYER_TYPES[1], LAYER_TYPES[2], LAYER_TYPES[1], LAYER_TYPES[2]],
        compress_rates={LAYER_TYPES[1]: 4, LAYER_TYPES[2]: 8},
        mlp_layer_types=["hash_moe", "moe", "moe", "moe", "moe"],
        hc_mult=2,
        sliding_window=8,
        o_groups=2,
        o_lora_rank=16,
        index_n_heads=16,  # real V4: 64; few heads tie at relu 0 and make top-k depend on the batch
        index_head_dim=16,
        index_topk=4,
        num_nextn_predict_layers=0,
    ),
    tiny_init=_fill,
)
