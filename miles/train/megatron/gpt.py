"""megatron-core's GPTModel as the Megatron backend's default architecture (architectures.py): the
families convert.py maps (Qwen2/Qwen3/Llama, Qwen3-MoE, DeepSeek-V3's latent attention), built by
model.py and exported by weights.py."""

from __future__ import annotations

from typing import Any

from miles.train.megatron import convert, weights
from miles.train.megatron import model as M
from miles.train.megatron.architectures import Architecture


def _build(hf_cfg: Any, tf: Any):
    from megatron.core import parallel_state as ps

    return M.build_gpt(hf_cfg, tf, ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage())


def _to_hf(full: dict, hf_cfg: Any, te_names: bool = False) -> dict:
    return convert.megatron_to_hf(full, convert.Shapes.from_hf(hf_cfg, te_names=te_names))


ARCHITECTURE = Architecture(
    name="gpt",
    spec="miles/train/megatron/model.py (megatron-core GPTModel)",
    config=M.transformer_config,
    build=_build,
    load=M.load_hf_into,
    export=weights.export_buckets,
    to_hf=_to_hf,
    layer_offset=M.layer_offset,
    packs=lambda hf_cfg: getattr(hf_cfg, "kv_lora_rank", None) is None,  # MLA takes whole rows only
)
