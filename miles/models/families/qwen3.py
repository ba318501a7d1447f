"""Qwen3: Llama's decoder with per-head RMS norms of q and k before RoPE."""

from miles.models.families.base import Family

FAMILY = Family(hf_arch="Qwen3ForCausalLM", model_type="qwen3", config_class="Qwen3Config", qk_norm=True)
