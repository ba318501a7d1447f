"""DeepSeek-V3 (the shape of Kimi-K2 and GLM-5 as well): multi-head latent attention and routed
experts with a shared expert.

Attention (MLA): q = W_qb RMSNorm(W_qa x) split per head into a no-RoPE part and a RoPE part;
[c; k_r] = W_kva x, where c (kv_lora_rank) is RMS-normed and k_r (qk_rope_head_dim) is one RoPE key
shared by all heads; per head, k = [W_uk c; k_r] and v = W_uv c with W_kvb = [W_uk; W_uv]. A cache
holds c and k_r per token, not the expanded keys and values. RoPE pairs are interleaved
(`rope_interleave`). MoE layers (after `first_k_dense_replace` dense ones): sigmoid scores, plus a
correction bias for the choice only, the best `topk_group` of `n_group` expert groups (a group scores
the sum of its two best), top-k within them, weights normalised and scaled by `routed_scaling_factor`;
a shared expert adds to every token.
"""

from __future__ import annotations

from miles.models.families.base import Family


def sparse_layers(
    num_layers: int, first_k_dense_replace: int | None, moe_layer_freq: int | None
) -> list[int]:
    """DeepSeek's MoE layers: from `first_k_dense_replace` on, every `moe_layer_freq`-th."""
    first, freq = int(first_k_dense_replace or 0), int(moe_layer_freq or 1)
    return [i for i in range(first, num_layers) if i % freq == 0]


def group_limited(choice, n_group: int, topk_group: int):
    """`choice` [T, E] (scores plus correction bias) with every expert outside the `topk_group` best of
    `n_group` groups set to -inf; a group scores the sum of its two best. The engine's router and the
    trainer's replayed one both choose through it."""
    if n_group <= 1:
        return choice
    T = choice.shape[0]
    by_group = choice.view(T, n_group, -1)
    best = by_group.topk(2, dim=-1).values.sum(dim=-1).topk(topk_group, dim=-1, sorted=False).indices
    keep = by_group.new_zeros(T, n_group, dtype=bool).scatter_(1, best, True)
    return by_group.masked_fill(~keep[..., None], float("-inf")).view(T, -1)


def _fill(model, seed: int) -> None:
    """Random correction biases (transformers initialises them to zero): the choice and the weights
    then see different scores, as in a trained checkpoint."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.copy_(torch.rand(buf.shape, generator=gen) * 0.1)


FAMILY = Family(
    hf_arch="DeepseekV3ForCausalLM",
    model_type="deepseek_v3",
    config_class="DeepseekV3Config",
    moe=True,
    attention="mla",
    backends=("engine", "fsdp", "megatron"),
    tiny=dict(
        num_hidden_layers=3,
        num_key_value_heads=4,
        first_k_dense_replace=1,
        n_routed_experts=8,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=4,  # topk / topk_group = 2 experts a group, DeepSeek-V3's own ratio (8 / 4)
        n_shared_experts=1,
        moe_intermediate_size=32,
        routed_scaling_factor=2.5,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        num_mtp_layers=0,
    ),
    tiny_init=_fill,
)
