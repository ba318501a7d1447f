"""DeepSeek-V4 on Megatron: the decoder of its Megatron modules, its config and its weight conversion.

`DeepseekV4GPT` is embedding -> `hc_mult` copies of each token's embedding (the streams) -> per layer
{attn_hc, input_layernorm, `HybridAttention`, ffn_hc, post_attention_layernorm, megatron-core's MoE
layer with DeepSeek-V4's router} -> `HyperHead` -> final norm -> output projection, sequence-first
inside as Megatron is ([s, b, N, D] streams), token ids in and logits [b, s, vocab] out, as
`GPTModel(input_ids, position_ids, attention_mask)` gives them. Modules: deepseek_v4_attention.py,
deepseek_v4_hc.py, deepseek_v4_moe.py. One pipeline stage, one tensor-parallel rank; experts split
over expert-parallel ranks as megatron-core's MoE layer splits them.

Conversion (`to_megatron`, `to_checkpoint`): a checkpoint in DeepSeek's spelling (what transformers
writes; miles/models/families/deepseek_v4.py's `hf_name`) or transformers' in-memory names, to this
model's names and back to DeepSeek's spelling; an expert's (and the shared expert's) gate and up
projections are stacked as megatron-core's fc1 [gate; up]; everything else is one to one. Routing
replay (miles/train/megatron/moe.py) finds the learned routers as it finds any megatron-core router.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module

from miles.engine.v4_spec import V4Spec
from miles.models.families import deepseek_v4 as family
from miles.train.megatron import deepseek_v4_moe as moe
from miles.train.megatron.deepseek_v4_attention import HybridAttention, RMSNorm
from miles.train.megatron.deepseek_v4_hc import HyperConnection, HyperHead, mix


def transformer_config(
    hf_cfg: Any, dtype: torch.dtype, use_cpu: bool = False, ep: int = 1, extra: dict | None = None
):
    """The megatron-core TransformerConfig of a DeepSeek-V4 HF config (its MoE and activation fields;
    the attention and hyper-connections read the V4Spec)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(
        num_layers=hf_cfg.num_hidden_layers, hidden_size=hf_cfg.hidden_size,
        num_attention_heads=hf_cfg.num_attention_heads, ffn_hidden_size=hf_cfg.moe_intermediate_size,
        num_moe_experts=hf_cfg.n_routed_experts, moe_router_topk=hf_cfg.num_experts_per_tok,
        moe_ffn_hidden_size=hf_cfg.moe_intermediate_size,
        moe_shared_expert_intermediate_size=hf_cfg.moe_intermediate_size * int(hf_cfg.n_shared_experts or 1),
        moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.0, moe_router_score_function="sigmoid",
        moe_router_topk_scaling_factor=float(hf_cfg.routed_scaling_factor), moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0, moe_enable_routing_replay=True, moe_grouped_gemm=False,
        moe_token_dispatcher_type="alltoall", expert_model_parallel_size=ep,
        gated_linear_unit=True, activation_func=F.silu, activation_func_clamp_value=float(hf_cfg.swiglu_limit),
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False,
        normalization="RMSNorm", layernorm_epsilon=hf_cfg.rms_norm_eps, use_cpu_initialization=use_cpu,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, variable_seq_lengths=True,
    )  # fmt: skip
    return TransformerConfig(**(fields | (extra or {})))


class DecoderLayer(MegatronModule):
    """One DeepSeek-V4 layer over the streams: attention and MoE, each between two mHC mixes."""

    def __init__(self, config: Any, spec: V4Spec, layer: int, vocab_size: int) -> None:
        super().__init__(config=config)
        hc = (spec.hc_mult, spec.hc_sinkhorn_iters, spec.hc_eps, spec.eps)
        self.attn_hc, self.ffn_hc = HyperConnection(config, *hc), HyperConnection(config, *hc)
        self.input_layernorm = RMSNorm(config.hidden_size, spec.eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, spec.eps)
        self.self_attn = HybridAttention(config, spec, layer)
        router = moe.hash_router(vocab_size) if layer in spec.hash_layers else moe.SqrtSoftplusRouter
        self.mlp = build_module(moe.moe_spec(router), config=config, layer_number=layer + 1)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        post, comb, x = self.attn_hc(streams)
        streams = mix(post, comb, self.self_attn(self.input_layernorm(x)), streams)
        post, comb, x = self.ffn_hc(streams)
        out, _ = self.mlp(self.post_attention_layernorm(x))
        return mix(post, comb, out, streams)


class DeepseekV4GPT(MegatronModule):
    """The whole model (module docstring), or one pipeline stage of it: `layers` (global indices, in
    order; default all), the embedding on the first stage, the head on the last. A later stage takes
    the streams [s, b, N, D] from `set_input_tensor`; a stage before the last returns its streams.
    Layers keep their global numbers in the state dict (`layers.<i>`), so every stage converts alike."""

    def __init__(self, hf_cfg: Any, config: Any, layers: range | None = None) -> None:
        super().__init__(config=config)
        spec = V4Spec.from_config(hf_cfg.to_dict())
        layers = range(hf_cfg.num_hidden_layers) if layers is None else layers
        self.hc_mult, self.pre_process = spec.hc_mult, layers.start == 0
        self.post_process = layers.stop == hf_cfg.num_hidden_layers
        if self.pre_process:
            self.embed_tokens = torch.nn.Embedding(hf_cfg.vocab_size, hf_cfg.hidden_size)
        self.layers = torch.nn.ModuleDict(
            {str(i): DecoderLayer(config, spec, i, hf_cfg.vocab_size) for i in layers}
        )
        if self.post_process:
            self.hc_head = HyperHead(config, spec.hc_mult, spec.hc_eps, spec.eps)
            self.norm = RMSNorm(hf_cfg.hidden_size, spec.eps)
            self.lm_head = torch.nn.Linear(hf_cfg.hidden_size, hf_cfg.vocab_size, bias=False)
        self.tokens = moe.watch_token_ids(self)
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        self.input_tensor = tensor

    def forward(self, input_ids: torch.Tensor, position_ids=None, attention_mask=None) -> torch.Tensor:
        if self.pre_process:
            x = self.embed_tokens(input_ids).transpose(0, 1)  # [s, b, D]
            streams = x.unsqueeze(2).expand(-1, -1, self.hc_mult, -1).contiguous()
        else:
            streams = self.input_tensor
        for layer in self.layers.values():
            streams = layer(streams)
        if not self.post_process:
            return streams
        return self.lm_head(self.norm(self.hc_head(streams))).transpose(0, 1)


_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_SHARED = re.compile(r"^model\.layers\.(\d+)\.mlp\.shared_experts\.(gate|up|down)_proj\.weight$")
_GATE = {"gate.weight": "router.weight", "gate.e_score_correction_bias": "router.expert_bias",
         "gate.tid2eid": "router.tid2eid"}  # fmt: skip
_ROUTER = {v: k for k, v in _GATE.items()}
_MG_EXPERT = re.compile(
    r"^layers\.(\d+)\.mlp\.(?:experts\.local_experts\.(\d+)|shared_experts)\.linear_fc([12])\.weight$"
)


def to_megatron(checkpoint: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This model's state dict from a checkpoint's tensors (DeepSeek's spelling or in-memory names)."""
    hf, out, pairs = family.hf_names(checkpoint), {}, {}
    for name, t in hf.items():
        if m := (_EXPERT.match(name) or _SHARED.match(name)):
            expert = f"experts.local_experts.{m.group(2)}" if m.re is _EXPERT else "shared_experts"
            pairs.setdefault((m.group(1), expert), {})[m.group(m.re.groups)] = t
        elif m := re.match(r"^model\.layers\.(\d+)\.mlp\.(gate\.\w+)$", name):
            out[f"layers.{m.group(1)}.mlp.{_GATE[m.group(2)]}"] = t
        else:
            out[name.removeprefix("model.")] = t
    for (layer, expert), p in pairs.items():
        out[f"layers.{layer}.mlp.{expert}.linear_fc1.weight"] = torch.cat([p["gate"], p["up"]])
        out[f"layers.{layer}.mlp.{expert}.linear_fc2.weight"] = p["down"]
    return out


def load(model: torch.nn.Module, checkpoint: dict[str, torch.Tensor]) -> None:
    """Copy a checkpoint's tensors (`to_megatron`) into `model` (the whole model, one rank); a name
    either side lacks is an error naming it."""
    missing, unexpected = model.load_state_dict(to_megatron(checkpoint), strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]  # megatron-core's own, not weights
    if missing or unexpected:
        raise KeyError(
            f"DeepSeek-V4 checkpoint: no tensor for {missing[:5]}; no parameter for {unexpected[:5]}"
        )


def to_checkpoint(state: dict[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
    """The checkpoint, under its own `names` (DeepSeek's spelling, or in-memory names), of this model's
    state dict (the inverse of to_megatron)."""
    spelled = {family.hf_name(k): k for k in names}
    hf = {}
    for name, t in state.items():
        if m := _MG_EXPERT.match(name):
            layer, expert, fc = m.groups()
            base = f"model.layers.{layer}.mlp." + (f"experts.{expert}" if expert else "shared_experts")
            if fc == "1":
                hf[f"{base}.gate_proj.weight"], hf[f"{base}.up_proj.weight"] = t.chunk(2)
            else:
                hf[f"{base}.down_proj.weight"] = t
        elif m := re.match(r"^layers\.(\d+)\.mlp\.(router\.\w+)$", name):
            hf[f"model.layers.{m.group(1)}.mlp.{_ROUTER[m.group(2)]}"] = t
        else:
            hf[name if name == "lm_head.weight" else f"model.{name}"] = t
    return {spelled.get(k, k): t for k, t in hf.items()}
