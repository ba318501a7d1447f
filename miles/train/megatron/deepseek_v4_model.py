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
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.enums import ModelType
from megatron.core.transformer.module import MegatronModule

from miles.engine.v4_spec import V4Spec
from miles.models.families import deepseek_v4 as family
from miles.train.megatron import convert
from miles.train.megatron import deepseek_v4_moe as moe
from miles.train.megatron.architectures import Architecture
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
        moe_router_score_function="sigmoid",
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
        self.mlp = moe.build_moe(router, config, layer + 1)

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

    share_embeddings_and_output_weights = False  # what megatron-core's gradient finalisation asks
    model_type = ModelType.encoder_or_decoder  # what its pipeline schedules ask

    def set_input_tensor(self, tensor: torch.Tensor | list | None) -> None:
        """The previous stage's output (Megatron's schedule hands a one-element list)."""
        self.input_tensor = tensor[0] if isinstance(tensor, list) else tensor

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids=None,
        attention_mask=None,
        packed_seq_params=None,
        output_processor=None,
    ) -> torch.Tensor:
        """Logits [b, s, V] (or `output_processor`'s pick, as GPTModel's hook gives it) on the last
        stage; on a stage before it the streams folded to three dimensions (`fold`). Every row is one
        sequence from position 0 (no packed rows: `packed_seq_params` must be None)."""
        if packed_seq_params is not None:
            raise ValueError("DeepseekV4GPT takes one sequence per row, not packed rows")
        if self.pre_process:
            x = self.embed_tokens(input_ids).transpose(0, 1)  # [s, b, D]
            streams = x.unsqueeze(2).expand(-1, -1, self.hc_mult, -1).contiguous()
        else:
            streams = unfold(self.input_tensor, self.hc_mult)
        for layer in self.layers.values():
            streams = layer(streams)
        if not self.post_process:
            return fold(streams)
        hidden = self.norm(self.hc_head(streams))  # [s, b, D]
        if output_processor is not None:
            return output_processor(
                hidden_states=hidden, output_layer=self._head, output_weight=None, runtime_gather_output=None
            )
        return self.lm_head(hidden).transpose(0, 1)

    def _head(self, x: torch.Tensor, weight=None, runtime_gather_output=None):
        """The output projection as megatron-core's output layer is called: (logits, bias)."""
        return self.lm_head(x), None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
        """megatron-core's distributed-checkpoint form, each layer's own (its MoE layer numbers the
        experts globally), under the layers' global names."""
        from megatron.core.transformer.utils import sharded_state_dict_default

        out = {}
        for name, module in self.named_children():
            if name == "layers":
                for i, layer in module.items():
                    out.update(
                        sharded_state_dict_default(layer, f"{prefix}layers.{i}.", sharded_offsets, metadata)
                    )
            else:
                out.update(sharded_state_dict_default(module, f"{prefix}{name}.", sharded_offsets, metadata))
        return out


def fold(streams: torch.Tensor) -> torch.Tensor:
    """[s, b, N, D] streams as [s * N, b, D], the three dimensions Megatron's pipeline sends."""
    s, b, n, d = streams.shape
    return streams.permute(0, 2, 1, 3).reshape(s * n, b, d)


def unfold(x: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of `fold`."""
    sn, b, d = x.shape
    return x.reshape(sn // n, n, b, d).permute(0, 2, 1, 3)


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
    return {spelled.get(k, k): t for k, t in iter_hf(state.items())}


def iter_hf(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """(transformers' in-memory name, tensor) of each (this model's global name, tensor), one at a time:
    an fc1 [gate; up] leaves as its two halves."""
    for name, t in named:
        if m := _MG_EXPERT.match(name):
            layer, expert, fc = m.groups()
            base = f"model.layers.{layer}.mlp." + (f"experts.{expert}" if expert else "shared_experts")
            if fc == "1":
                gate, up = t.chunk(2)
                yield f"{base}.gate_proj.weight", gate
                yield f"{base}.up_proj.weight", up
            else:
                yield f"{base}.down_proj.weight", t
        elif m := re.match(r"^layers\.(\d+)\.mlp\.(router\.\w+)$", name):
            yield f"model.layers.{m.group(1)}.mlp.{_ROUTER[m.group(2)]}", t
        else:
            yield (name if name == "lm_head.weight" else f"model.{name}"), t


# ---- the Megatron backend's architecture (architectures.py) -------------------------------------


def stage_layers(hf_cfg: Any, pp: int, stage: int, first: int | None, last: int | None) -> range:
    """The global layers of pipeline stage `stage` of `pp` (megatron-core's split rule: `first` / `last`
    layers on the end stages when given, the rest even)."""
    from miles.config.layout import stage_layers as sizes

    counts = sizes(hf_cfg.num_hidden_layers, pp, first, last)
    start = sum(counts[:stage])
    return range(start, start + counts[stage])


def _config(hf_cfg: Any, dtype: Any, tp: int, pp: int, ep: int = 1, stage_layers=(None, None), extra=None):
    split = {
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "num_layers_in_first_pipeline_stage": stage_layers[0],
        "num_layers_in_last_pipeline_stage": stage_layers[1],
    }
    return transformer_config(hf_cfg, dtype, ep=ep, extra=split | (extra or {}))


def _build(hf_cfg: Any, tf: Any) -> DeepseekV4GPT:
    from megatron.core import parallel_state as ps

    pp, stage = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    first, last = tf.num_layers_in_first_pipeline_stage, tf.num_layers_in_last_pipeline_stage
    return DeepseekV4GPT(hf_cfg, tf, stage_layers(hf_cfg, pp, stage, first, last))


def load_stage(model: torch.nn.Module, checkpoint: dict[str, torch.Tensor], hf_cfg: Any) -> None:
    """Copy this rank's part of a whole checkpoint into its stage: the stage's layers, and of the
    routed experts those of its expert-parallel rank (numbered from 0). A name either side lacks is an
    error naming it."""
    from megatron.core import parallel_state as ps

    full = to_megatron(checkpoint)
    ep = ps.get_expert_model_parallel_world_size()
    full = convert.ep_shard(full, ps.get_expert_model_parallel_rank(), ep, convert.Shapes.from_hf(hf_cfg))
    own = {k for k in model.state_dict() if not k.endswith("_extra_state")}
    missing = sorted(own - set(full))
    if missing:
        raise KeyError(f"DeepSeek-V4 checkpoint: no tensor for {missing[:5]}")
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name not in own:
                continue
            if full[name].shape != t.shape:
                raise ValueError(
                    f"{name}: the checkpoint gives {tuple(full[name].shape)}, the model has {tuple(t.shape)}"
                )
            t.copy_(full[name])


def _export(model: torch.nn.Module, hf_cfg: Any, bucket_bytes: int, contract: Any = None):
    from miles.train.megatron.weights import iter_megatron_full
    from miles.train.quant import export_pairs
    from miles.weights.bucket import iter_buckets

    named = iter_hf(iter_megatron_full(model, convert.Shapes.from_hf(hf_cfg), offset=0))
    return iter_buckets(export_pairs(named, contract), bucket_bytes)


ARCHITECTURE = Architecture(
    name="deepseek_v4",
    spec="miles/train/megatron/deepseek_v4_model.py (DeepseekV4GPT: hybrid attention, mHC, hash routing)",
    config=_config,
    build=_build,
    load=load_stage,
    export=_export,
    to_hf=lambda full, hf_cfg, te_names=False: to_checkpoint(full, []),
    layer_offset=lambda model: 0,  # its stages name layers by their global number
    packs=lambda hf_cfg: False,
    lacks={
        "lora": "the DeepSeek-V4 modules take no adapters; use train.backend=fsdp for LoRA",
        "quantization": "no fake-quantised forward for its modules; set train.quantization=none",
        "critic": "no value head; use train.loss.advantage=grpo (or another critic-free estimator)",
        "tensor_parallel": "its attention and hyper-connections are not split over ranks; set "
        "train.tensor_parallel=1 and split with train.pipeline_parallel / train.expert_parallel",
        "recompute": "its layers keep their activations; set train.recompute=none",
    },
)
