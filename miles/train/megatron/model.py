"""Build a Megatron-core GPTModel from a Hugging Face config and load / read its HF weights.

Megatron's local layer spec is used (no Transformer Engine needed), with one change: its core
attention materialises the [b, heads, s, s] score matrix, so it is swapped for `SDPAttention`,
PyTorch's fused attention kernels (same maths: softmax(q k^T / sqrt(d) + causal) v; packed rows
through a variable-length kernel). Where
Transformer Engine is installed its own spec is used unchanged. Mixture-of-experts models (Qwen3-MoE)
get per-layer specs and their MoE fields from miles/train/megatron/moe.py. Imports megatron lazily
(callers import this module only when `train.backend` is megatron).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from miles.models.families import family_of_model_type
from miles.train.megatron import convert, moe
from miles.train.varlen_attention import packed_causal_attention


@functools.cache
def has_transformer_engine() -> bool:
    """Whether Transformer Engine is importable (asked once: the import attempt is not cheap)."""
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


class SDPAttention(torch.nn.Module):
    """Core attention for Megatron's SelfAttention through PyTorch's fused attention kernels.

    Causal self-attention on right-padded [s, b] batches (padding follows every real token, so the
    causal mask alone keeps real tokens from seeing it) through scaled_dot_product_attention; or, given
    `packed_seq_params` (qkv_format "sbhd", from `packed_seq_params` below), over the sequences packed
    into one row, each seeing only its own earlier tokens, by the variable-length kernel of
    miles/train/varlen_attention.py. No explicit mask, no attention bias.
    """

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, **kwargs: Any) -> None:
        super().__init__()
        self.scale = kwargs.get("softmax_scale")
        self.heads_per_group = config.num_attention_heads // config.num_query_groups
        latent = getattr(config, "multi_latent_attention", False)
        self.shared_rope = (
            config.qk_pos_emb_head_dim if latent and config.tensor_model_parallel_size > 1 else 0
        )
        """Latent attention over tensor-parallel ranks: the width of the RoPE key part every head shares
        (`SharedRopeKeyGrad`), else 0."""

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        assert attention_mask is None and attention_bias is None, "SDPAttention: no mask, no bias"
        if self.shared_rope and key.requires_grad:
            key = SharedRopeKeyGrad.apply(key, self.shared_rope)
        s, b = query.shape[0], query.shape[1]
        if packed_seq_params is not None:
            assert b == 1 and packed_seq_params.qkv_format == "sbhd", "packed: one [T, 1] row"
            p = packed_seq_params
            out = packed_causal_attention(
                query[:, 0], key[:, 0], value[:, 0], p.cu_seqlens_q, p.max_seqlen_kv, self.scale
            )
            return out.reshape(s, b, -1)
        # [s, b, heads, d] -> [b, heads, s, d]; kv heads repeated so any SDPA kernel applies.
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if self.heads_per_group > 1:
            k = k.repeat_interleave(self.heads_per_group, dim=1)
            v = v.repeat_interleave(self.heads_per_group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


class SharedRopeKeyGrad(torch.autograd.Function):
    """Identity forward; backward, the gradient of the keys' shared RoPE part made whole.

    DeepSeek's latent attention gives every head the same RoPE key k_pe (one projection, broadcast to
    the heads). Over tensor-parallel ranks each rank holds some heads, so the gradient of k_pe its heads
    give is only that rank's share; megatron-core's local spec then gathers the down projection's
    output, whose backward keeps each rank's own slice of that partial gradient, and the k_pe rows of
    the down projection (and the hidden states' gradient through them) miss the other ranks' heads.
    Here the heads' summed k_pe gradient is all-reduced over the tensor-parallel group and the difference
    spread over this rank's heads, so the broadcast's backward (a sum over the heads) yields the whole
    gradient on every rank. tests/integration/test_megatron_mla_ranks.py checks TP=2 against one rank."""

    @staticmethod
    def forward(ctx, key: torch.Tensor, rope: int) -> torch.Tensor:
        ctx.rope = rope
        return key.view_as(key)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        grad = grad.clone()
        part = grad[..., -ctx.rope :]  # [s, b, heads, rope]
        mine = part.sum(dim=-2, keepdim=True)
        whole = mine.clone()
        dist.all_reduce(whole, group=ps.get_tensor_model_parallel_group())
        part += (whole - mine) / part.shape[-2]
        return grad, None


def packed_seq_params(mb: Any):
    """Megatron's PackedSeqParams for micro-batch `mb` (miles/train/megatron/batch.py) of several
    sequences in one row, else None. qkv_format "sbhd": the row keeps its [s, b] layout and RoPE its row
    positions; only the core attention reads the offsets. GPTModel sizes its rotary table by the
    larger of the two max_seqlen fields, so max_seqlen_q is the row's length and max_seqlen_kv the
    longest sequence (the bound SDPAttention gives the variable-length kernel)."""
    if mb.cu_seqlens is None:
        return None
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams(
        qkv_format="sbhd",
        cu_seqlens_q=mb.cu_seqlens,
        cu_seqlens_kv=mb.cu_seqlens,
        max_seqlen_q=mb.tokens.shape[1],
        max_seqlen_kv=mb.max_seqlen,
    )


_FUSIONS_OFF = dict(
    bias_dropout_fusion=False,
    masked_softmax_fusion=False,
    apply_rope_fusion=False,
    persist_layer_norm=False,
    gradient_accumulation_fusion=False,
)
"""Megatron's fused kernels that need Apex or Transformer Engine (or assume a layout Miles does not use)."""


def transformer_config(
    hf_cfg: Any,
    dtype: torch.dtype,
    tp: int,
    pp: int,
    use_cpu: bool = False,
    ep: int = 1,
    stage_layers: tuple[int | None, int | None] = (None, None),
    extra: dict | None = None,
):
    """Megatron TransformerConfig equivalent to a Qwen2/Qwen3/Llama/Qwen3-MoE HF config; `ep` experts
    split over expert-parallel ranks, `stage_layers` the layers of the first / last pipeline stage
    (None: Megatron's even split); `extra` more TransformerConfig fields (e.g. activation recompute)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    s = convert.Shapes.from_hf(hf_cfg)
    family = family_of_model_type(hf_cfg.model_type)  # ValueError naming the known ones
    family.refuse_unless("megatron")
    moe.check(hf_cfg)
    cls, latent = TransformerConfig, {}
    if family.attention == "mla":
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        cls, latent = MLATransformerConfig, _mla_kwargs(hf_cfg)
    fields = dict(
        num_layers=s.num_layers,
        hidden_size=s.hidden,
        ffn_hidden_size=hf_cfg.intermediate_size,
        num_attention_heads=s.num_heads,
        num_query_groups=s.num_kv_heads,
        kv_channels=s.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=hf_cfg.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=family.qkv_bias or bool(getattr(hf_cfg, "attention_bias", False)),
        qk_layernorm=family.qk_norm or family.attention == "mla",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # SwiGLU as one compiled kernel each way (megatron's torch.compile fuser; needs no TE)
        bias_activation_fusion=not use_cpu and torch.cuda.is_available(),
        **_FUSIONS_OFF,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",  # the one dispatcher that takes variable sequence lengths
        use_cpu_initialization=use_cpu,
        num_layers_in_first_pipeline_stage=stage_layers[0],
        num_layers_in_last_pipeline_stage=stage_layers[1],
        **moe.config_kwargs(hf_cfg, ep),
    )
    if fields.get("moe_router_score_function") == "sigmoid" and has_transformer_engine():
        fields["moe_router_dtype"] = "fp32"  # DeepSeek's router scores in fp32 (without TE: no such GEMM)
    return cls(**(fields | latent | (extra or {})))  # `extra` wins (e.g. a CPU test's token dispatcher)


def _mla_kwargs(hf_cfg: Any) -> dict[str, Any]:
    """MLATransformerConfig's latent attention fields of a DeepSeek-V3 config (plain RoPE; the q and kv
    latents RMS-normed)."""
    return dict(
        multi_latent_attention=True,
        q_lora_rank=hf_cfg.q_lora_rank,
        kv_lora_rank=hf_cfg.kv_lora_rank,
        qk_head_dim=hf_cfg.qk_nope_head_dim,
        qk_pos_emb_head_dim=hf_cfg.qk_rope_head_dim,
        v_head_dim=hf_cfg.v_head_dim,
        rope_type="rope",
        rotary_base=rope_theta(hf_cfg),
    )  # megatron-core de-interleaves DeepSeek's RoPE pairs itself (convert._rope_rows: the other layout)


def _moe_utils_without_te() -> None:
    """megatron-core's router GEMM reads `te_general_gemm`, which its module defines only when
    Transformer Engine imports; without TE, define it as absent so the plain GEMM runs."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _mla_module_without_te() -> None:
    """megatron-core's MLA module takes Transformer Engine as present when its extension module imports
    with placeholders instead of TE's classes (a host without TE), and then fails at
    `isinstance(x, TELinear)`; tell it the truth."""
    from megatron.core.transformer import multi_latent_attention as mla

    if not isinstance(mla.TELinear, type):
        mla.HAVE_TE = False


def layer_spec(tf_cfg: Any):
    """Transformer Engine's layer spec where installed, else the local spec with SDPAttention; an MoE
    model gets this stage's list of per-layer specs (dense or MoE)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if getattr(tf_cfg, "multi_latent_attention", False):
        _mla_module_without_te()
    if tf_cfg.num_moe_experts:
        _moe_utils_without_te()
        return moe.block_spec(tf_cfg, has_transformer_engine(), SDPAttention)
    if has_transformer_engine():
        return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=tf_cfg.qk_layernorm)
    spec = specs.get_gpt_layer_local_spec(qk_layernorm=tf_cfg.qk_layernorm, normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec


def build_gpt(hf_cfg: Any, tf_cfg: Any, pre_process: bool = True, post_process: bool = True):
    """The GPTModel of this pipeline stage (layers are split by Megatron's own rule)."""
    from megatron.core.models.gpt import GPTModel

    return GPTModel(
        config=tf_cfg,
        transformer_layer_spec=layer_spec(tf_cfg),
        vocab_size=hf_cfg.vocab_size,
        max_sequence_length=hf_cfg.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=False,
        share_embeddings_and_output_weights=bool(getattr(hf_cfg, "tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_base=rope_theta(hf_cfg),
    )


def rope_theta(hf_cfg: Any) -> int:
    """RoPE base: transformers 5 keeps it in rope_parameters, 4.x as rope_theta."""
    params = getattr(hf_cfg, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default":
        raise ValueError(f"rope scaling {params.get('rope_type')!r} has no Megatron mapping here")
    return int(params.get("rope_theta") or hf_cfg.rope_theta)


def shapes_of(hf_cfg: Any) -> convert.Shapes:
    return convert.Shapes.from_hf(hf_cfg, te_names=has_transformer_engine())


def layer_offset(model: torch.nn.Module) -> int:
    """Global index of this stage's first layer."""
    layers = model.decoder.layers
    return layers[0].layer_number - 1 if len(layers) else 0


def load_hf_into(model: torch.nn.Module, hf_state: dict[str, torch.Tensor], hf_cfg: Any) -> None:
    """Copy a full HF state dict into this rank's GPTModel (its pipeline stage, TP slice and experts)."""
    from megatron.core import parallel_state as ps

    s = shapes_of(hf_cfg)
    full = convert.hf_to_megatron(hf_state, s)
    if s.num_experts:
        ep = ps.get_expert_model_parallel_world_size()
        full = convert.ep_shard(full, ps.get_expert_model_parallel_rank(), ep, s)
    tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    offset = layer_offset(model)
    own = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    for local_name, param in own.items():
        name = convert.to_global(local_name, offset)
        if name not in full and name == "output_layer.weight" and s.tied:
            name = "embedding.word_embeddings.weight"
        if name not in full:
            raise KeyError(f"no HF weight maps to Megatron parameter {name!r}")
        shard = convert.tp_shard(name, full[name], tp_rank, tp_size, s)
        if shard.shape != param.shape:
            raise ValueError(f"{name}: HF gives {tuple(shard.shape)}, model has {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(shard)


def read_hf_state(path: str) -> dict[str, torch.Tensor]:
    """All tensors of the safetensors files of an HF model directory (on CPU)."""
    from pathlib import Path

    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path} (model.path must be an HF model directory)")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state
