"""Qwen2 / Qwen2.5: Llama's decoder with biases on the q/k/v projections."""

from miles.models.families.base import Family

FAMILY = Family(hf_arch="Qwen2ForCausalLM", model_type="qwen2", config_class="Qwen2Config", qkv_bias=True)
