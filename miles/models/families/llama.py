"""Llama: the plain decoder (no biases, no q/k norms, dense MLPs)."""

from miles.models.families.base import Family

FAMILY = Family(hf_arch="LlamaForCausalLM", model_type="llama", config_class="LlamaConfig")
