"""Qwen3-MoE: Qwen3's attention with routed-expert MLPs on its sparse layers."""

from miles.models.families.base import Family

FAMILY = Family(
    hf_arch="Qwen3MoeForCausalLM",
    model_type="qwen3_moe",
    config_class="Qwen3MoeConfig",
    qk_norm=True,
    moe=True,
)
