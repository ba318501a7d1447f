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

from miles.models.families.base import Family

LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")


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
    backends=("fsdp",),
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
        index_n_heads=2,
        index_head_dim=16,
        index_topk=4,
        num_nextn_predict_layers=0,
    ),
    tiny_init=_fill,
)
