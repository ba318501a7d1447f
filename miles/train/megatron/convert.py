"""Hugging Face <-> Megatron-core GPTModel: configs, parameter names, fused layouts, TP shards.

Dense decoder families (Qwen2, Qwen3, Llama) map one to one onto Megatron's GPTModel:

    HF                                              Megatron (global layer i)
    model.embed_tokens.weight                       embedding.word_embeddings.weight
    model.layers.i.input_layernorm.weight           decoder.layers.i.input_layernorm.weight
    model.layers.i.self_attn.{q,k,v}_proj.{w,b}     decoder.layers.i.self_attention.linear_qkv.{w,b}
    model.layers.i.self_attn.{q,k}_norm.weight      decoder.layers.i.self_attention.{q,k}_layernorm.weight
    model.layers.i.self_attn.o_proj.weight          decoder.layers.i.self_attention.linear_proj.weight
    model.layers.i.post_attention_layernorm.weight  decoder.layers.i.pre_mlp_layernorm.weight
    model.layers.i.mlp.{gate,up}_proj.weight        decoder.layers.i.mlp.linear_fc1.weight
    model.layers.i.mlp.down_proj.weight             decoder.layers.i.mlp.linear_fc2.weight
    model.norm.weight                               decoder.final_layernorm.weight
    lm_head.weight                                  output_layer.weight

Two tensors are fused. `linear_qkv` stores, for each of the G key/value groups in turn, that group's
Q heads (H/G heads), then its K head, then its V head: rows [g*(H/G+2)*d, (g+1)*(H/G+2)*d) belong to
group g, which is what HF's `repeat_kv` pairs (query head j uses kv head j // (H/G)). `linear_fc1`
is [gate; up]. Tensor parallelism splits column-parallel weights on rows and row-parallel ones on
columns; the fused tensors split per group / per half so that every rank holds whole heads and a
matching gate/up pair. With Transformer Engine's layer spec the two pre-norms live inside the
following linear (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`).

Mixture-of-experts layers (Qwen3-MoE) replace the MLP by a router and E experts. Megatron keeps the
experts as a list (`SequentialMLP`, no grouped GEMM without Transformer Engine); expert parallelism
gives each of the P expert-parallel ranks the E/P experts [r*E/P, (r+1)*E/P), numbered from 0 there:

    HF (sparse layer i, expert e)                   Megatron (global expert e)
    model.layers.i.mlp.gate.weight                  decoder.layers.i.mlp.router.weight
    model.layers.i.mlp.experts.e.{gate,up}_proj     decoder.layers.i.mlp.experts.local_experts.e.linear_fc1
    model.layers.i.mlp.experts.e.down_proj          decoder.layers.i.mlp.experts.local_experts.e.linear_fc2

Each expert's fc1 is [gate; up] and splits over tensor-parallel ranks like the dense one; the router is
replicated. The stacked in-memory names of transformers 5 (`mlp.experts.gate_up_proj` [E, 2I, H],
`mlp.experts.down_proj` [E, H, I]) are read too. A sparse layer keeps its own pre-MLP norm under
Transformer Engine's spec (nothing to fuse it into).

DeepSeek-V3's multi-token-prediction layers (checkpoint layers L, L+1, ... after the L decoder layers)
map onto megatron-core's MTP block: `enorm`, `hnorm`, `eh_proj` one to one, `shared_head.norm` ->
`final_layernorm`, the layer's decoder part under `mtp.layers.i.transformer_layer.` as any decoder
layer; its copies of the embedding and head are the model's (checked equal going in, written back
coming out).

Pure tensor code: nothing here imports megatron, so the mapping is testable without it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12]\.weight)$")
_EXPERT_NAME = re.compile(r"^((?:decoder\.)?layers\.\d+\.mlp\.experts\.local_experts\.)(\d+)(\..+)$")
"""An expert weight of GPTModel (`decoder.layers.`) or of a model naming its layers globally (`layers.`)."""

# Per-layer names that map one to one (local layer spec).
_LAYER_PLAIN = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
}
# Multi-head latent attention (DeepSeek-V3) and DeepSeek's MoE extras, also one to one.
_MLA_PLAIN = {
    "self_attn.q_proj.weight": "self_attention.linear_q_proj.weight",
    "self_attn.q_a_proj.weight": "self_attention.linear_q_down_proj.weight",
    "self_attn.q_a_layernorm.weight": "self_attention.q_layernorm.weight",
    "self_attn.q_b_proj.weight": "self_attention.linear_q_up_proj.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "self_attention.linear_kv_down_proj.weight",
    "self_attn.kv_a_layernorm.weight": "self_attention.kv_layernorm.weight",
    "self_attn.kv_b_proj.weight": "self_attention.linear_kv_up_proj.weight",
    "mlp.gate.e_score_correction_bias": "mlp.router.expert_bias",
    "mlp.shared_experts.down_proj.weight": "mlp.shared_experts.linear_fc2.weight",
}
# Transformer Engine's spec fuses the pre-norms into the next linear.
_TE_NORMS = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}
# Tensor-parallel split dimension per Megatron suffix (absent: replicated).
_TP_DIM = {
    "embedding.word_embeddings.weight": 0,
    "output_layer.weight": 0,
    "self_attention.linear_qkv.weight": 0,
    "self_attention.linear_qkv.bias": 0,
    "self_attention.linear_proj.weight": 1,
    "mlp.linear_fc1.weight": 0,
    "mlp.linear_fc2.weight": 1,
    # latent attention (DeepSeek-V3): the up projections split by heads (their rows are head-major),
    # the down projections by rows too on the local spec, where megatron-core gathers their output
    # (Transformer Engine's spec duplicates them instead: `_MLA_DUPLICATED_UNDER_TE`)
    "self_attention.linear_q_proj.weight": 0,
    "self_attention.linear_q_up_proj.weight": 0,
    "self_attention.linear_kv_up_proj.weight": 0,
    "self_attention.linear_q_down_proj.weight": 0,
    "self_attention.linear_kv_down_proj.weight": 0,
}
_MLA_DUPLICATED_UNDER_TE = (
    "self_attention.linear_q_down_proj.weight",
    "self_attention.linear_kv_down_proj.weight",
)


@dataclass(frozen=True)
class Shapes:
    """The few HF config numbers the mapping needs."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    tied: bool
    te_names: bool = False
    """Use Transformer Engine's fused-norm names instead of the local spec's."""
    moe_layers: tuple[int, ...] = ()
    """Indices of the sparse (mixture-of-experts) decoder layers; empty for a dense model."""
    num_experts: int = 0
    """Routed experts per sparse layer (0: dense)."""
    mla: bool = False
    """Multi-head latent attention (DeepSeek-V3): its projections map one to one (`_MLA_PLAIN`), but for
    the order of the RoPE rows (`mla_rope`)."""
    mla_rope: tuple[int, int, int] | None = None
    """(qk_nope_head_dim, qk_rope_head_dim, kv_lora_rank) of an MLA checkpoint whose RoPE rotates
    halves (`rope_interleave: false`); None for DeepSeek's interleaved pairs, megatron-core's own."""

    @classmethod
    def from_hf(cls, cfg, te_names: bool = False) -> Shapes:
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        experts = num_experts(cfg)
        return cls(
            cfg.num_hidden_layers,
            heads,
            kv,
            head_dim,
            cfg.hidden_size,
            cfg.vocab_size,
            bool(getattr(cfg, "tie_word_embeddings", False)),
            te_names,
            tuple(sparse_layers(cfg)) if experts else (),
            experts,
            getattr(cfg, "kv_lora_rank", None) is not None,
            (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank)
            if getattr(cfg, "kv_lora_rank", None) is not None and not getattr(cfg, "rope_interleave", True)
            else None,
        )


def num_experts(cfg) -> int:
    """Routed experts of an HF config: `num_experts` (published Qwen3-MoE checkpoints) or
    `num_local_experts` (what transformers 5 writes); 0 for a dense model."""
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        n = getattr(cfg, key, None)
        if isinstance(n, int) and n > 0:
            return n
    return 0


def sparse_layers(cfg) -> list[int]:
    """Qwen3-MoE's rule: layer i is sparse unless it is in `mlp_only_layers` or
    (i + 1) % decoder_sparse_step != 0; DeepSeek's: from `first_k_dense_replace` on, every
    `moe_layer_freq`-th."""
    if not num_experts(cfg):
        return []
    if getattr(cfg, "first_k_dense_replace", None) is not None:
        from miles.models.families import deepseek_v3

        return deepseek_v3.sparse_layers(
            cfg.num_hidden_layers, cfg.first_k_dense_replace, getattr(cfg, "moe_layer_freq", None)
        )
    dense = set(getattr(cfg, "mlp_only_layers", None) or [])
    step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
    return [i for i in range(cfg.num_hidden_layers) if i not in dense and (i + 1) % step == 0]


def _norm_name(suffix: str, shapes: Shapes, layer: int | None = None) -> str:
    sparse = layer is not None and layer in shapes.moe_layers and suffix == "pre_mlp_layernorm.weight"
    return _TE_NORMS.get(suffix, suffix) if shapes.te_names and not sparse else suffix


def pack_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: Shapes) -> torch.Tensor:
    """HF q/k/v (weights [out, in] or biases [out]) -> Megatron's group-interleaved linear_qkv."""
    g, d = s.num_kv_heads, s.head_dim
    rest = q.shape[1:]
    parts = (q.reshape(g, -1, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest))
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def unpack_qkv(qkv: torch.Tensor, s: Shapes) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of pack_qkv."""
    g, d = s.num_kv_heads, s.head_dim
    per_group = s.num_heads // g * d
    rest = qkv.shape[1:]
    grouped = qkv.reshape(g, per_group + 2 * d, *rest)
    q, k, v = grouped.split([per_group, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _rope_rows(name: str, t: torch.Tensor, s: Shapes, inverse: bool = False) -> torch.Tensor:
    """An MLA projection of a checkpoint that rotates halves, its RoPE output rows interleaved for
    megatron-core (`inverse`: back). megatron-core's MLA takes interleaved pairs (x0, x1), (x2, x3), ...
    as DeepSeek's checkpoints hold them and de-interleaves them itself before rotating halves; rows
    [x0..x(d/2-1); x(d/2)..x(d-1)] must therefore arrive as x0, x(d/2), x1, ... Other tensors pass."""
    if s.mla_rope is None:
        return t
    nope, rope, rank = s.mla_rope
    order = torch.cat((torch.arange(0, rope, 2), torch.arange(1, rope, 2)))  # what megatron-core takes
    if not inverse:
        order = torch.argsort(order)
    if name.endswith(("linear_q_up_proj.weight", "linear_q_proj.weight")):
        heads = t.view(-1, nope + rope, t.shape[-1])
        return torch.cat((heads[:, :nope], heads[:, nope:][:, order]), dim=1).reshape(t.shape)
    if name.endswith("linear_kv_down_proj.weight"):
        return torch.cat((t[:rank], t[rank:][order]), dim=0)
    return t


def hf_to_megatron(hf: dict[str, torch.Tensor], s: Shapes) -> dict[str, torch.Tensor]:
    """Full HF state dict -> full Megatron state dict (global layer numbers, no TP split); a
    checkpoint's multi-token-prediction layers (`mtp_layers`) under megatron-core's MTP names."""
    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"]}
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
    if not s.tied:
        out["output_layer.weight"] = hf["lm_head.weight"]
    for i in range(s.num_layers):
        out.update(_layer_to_megatron(hf, f"model.layers.{i}.", f"decoder.layers.{i}.", s, i))
    for i in range(mtp_layers(hf, s)):
        out.update(_mtp_to_megatron(hf, s, i))
    return out


def _layer_to_megatron(hf: dict[str, torch.Tensor], src: str, dst: str, s: Shapes, i: int) -> dict:
    """One decoder layer's tensors (HF prefix `src`) under Megatron names (prefix `dst`); `i` its index,
    which says whether it is sparse (an MTP layer is sparse when it holds a router)."""
    out = {}
    for hf_suffix, mg_suffix in (_LAYER_PLAIN | (_MLA_PLAIN if s.mla else {})).items():
        if src + hf_suffix in hf:
            out[dst + _norm_name(mg_suffix, s, i)] = _rope_rows(mg_suffix, hf[src + hf_suffix], s)
    if src + "mlp.shared_experts.gate_proj.weight" in hf:
        gate, up = (hf[f"{src}mlp.shared_experts.{p}_proj.weight"] for p in ("gate", "up"))
        out[dst + "mlp.shared_experts.linear_fc1.weight"] = torch.cat([gate, up], dim=0)
    attn = src + "self_attn."
    for kind in ("weight", "bias"):
        if f"{attn}q_proj.{kind}" in hf and not s.mla:
            q, k, v = (hf[f"{attn}{p}_proj.{kind}"] for p in "qkv")
            out[f"{dst}self_attention.linear_qkv.{kind}"] = pack_qkv(q, k, v, s)
    if i in s.moe_layers or (i >= s.num_layers and src + "mlp.gate.weight" in hf):
        out.update(_experts_to_megatron(hf, src, dst, s.num_experts))
    else:
        gate, up = hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]
        out[dst + "mlp.linear_fc1.weight"] = torch.cat([gate, up], dim=0)
    return out


# A multi-token-prediction layer (DeepSeek-V3's `num_nextn_predict_layers`, checkpoint layer L + i):
# its own tensors, one to one with megatron-core's MultiTokenPredictionLayer; its embedding and head
# are the model's (megatron-core shares them; the checkpoint holds copies, checked equal).
_MTP_PLAIN = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "shared_head.norm.weight": "final_layernorm.weight",
}
_MTP_SHARED = {
    "embed_tokens.weight": "model.embed_tokens.weight",
    "shared_head.head.weight": "lm_head.weight",
}
_MTP = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")


def mtp_layers(hf: dict[str, torch.Tensor], s: Shapes) -> int:
    """How many multi-token-prediction layers the checkpoint `hf` holds (after the decoder's)."""
    n = 0
    while f"model.layers.{s.num_layers + n}.eh_proj.weight" in hf:
        n += 1
    return n


def _mtp_to_megatron(hf: dict[str, torch.Tensor], s: Shapes, i: int) -> dict[str, torch.Tensor]:
    src, dst = f"model.layers.{s.num_layers + i}.", f"mtp.layers.{i}."
    for own, model in _MTP_SHARED.items():
        model = "model.embed_tokens.weight" if s.tied and model == "lm_head.weight" else model
        if src + own in hf and not torch.equal(hf[src + own], hf[model]):
            raise ValueError(f"{src}{own} differs from {model}: Megatron's MTP layer shares the model's")
    out = {dst + mg: hf[src + theirs] for theirs, mg in _MTP_PLAIN.items()}
    return out | _layer_to_megatron(hf, src, dst + "transformer_layer.", s, s.num_layers + i)


def _experts_to_megatron(hf: dict[str, torch.Tensor], src: str, dst: str, n: int) -> dict[str, torch.Tensor]:
    """One sparse layer's router and experts, from per-expert HF names or transformers 5's stacked ones."""
    out = {dst + "mlp.router.weight": hf[src + "mlp.gate.weight"]}
    stacked = src + "mlp.experts.gate_up_proj"
    for e in range(n):
        mine = f"{dst}mlp.experts.local_experts.{e}."
        if stacked in hf:  # [E, 2I, H] holds [gate; up] per expert, as linear_fc1 does
            fc1, fc2 = hf[stacked][e], hf[src + "mlp.experts.down_proj"][e]
        else:
            theirs = f"{src}mlp.experts.{e}."
            gate, up = hf[theirs + "gate_proj.weight"], hf[theirs + "up_proj.weight"]
            fc1, fc2 = torch.cat([gate, up], dim=0), hf[theirs + "down_proj.weight"]
        out[mine + "linear_fc1.weight"], out[mine + "linear_fc2.weight"] = fc1, fc2
    return out


def megatron_to_hf(mg: dict[str, torch.Tensor], s: Shapes) -> dict[str, torch.Tensor]:
    """Full Megatron state dict (global layer numbers) -> HF state dict; extra state is ignored."""
    return dict(iter_megatron_to_hf(mg.items(), s))


def iter_megatron_to_hf(
    items: Iterable[tuple[str, torch.Tensor]], s: Shapes
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream (megatron name, full tensor) -> (HF name, tensor); fused tensors expand to several."""
    inverse = {_norm_name(v, s): k for k, v in (_LAYER_PLAIN | (_MLA_PLAIN if s.mla else {})).items()}
    inverse["pre_mlp_layernorm.weight"] = "post_attention_layernorm.weight"  # sparse layers under TE
    shared: dict[str, torch.Tensor] = {}  # the embedding and head, which MTP layers repeat
    copies: list[tuple[str, str]] = []  # (an MTP layer's name of a copy, the model's name it copies)
    for name, t in items:
        if name.endswith("_extra_state"):
            continue
        if name == "embedding.word_embeddings.weight":
            yield "model.embed_tokens.weight", t
            shared["model.embed_tokens.weight"] = t
        elif name == "decoder.final_layernorm.weight":
            yield "model.norm.weight", t
        elif name == "output_layer.weight":
            yield "lm_head.weight", t
            shared["lm_head.weight"] = t
        elif (m := _MTP.match(name)) is not None:
            yield from _mtp_to_hf(int(m.group(1)), m.group(2), t, s, inverse, copies)
        else:
            m = _LAYER.match(name)
            if m is None:
                raise KeyError(f"unmapped Megatron parameter {name!r}")
            i, suffix = m.groups()
            yield from _layer_to_hf(f"model.layers.{i}.", suffix, t, s, inverse)
    for own, model in copies:  # the stream held the model's tensor: the checkpoint's copy of it
        if model in shared:
            yield own, shared[model]


def _mtp_to_hf(i: int, suffix: str, t: torch.Tensor, s: Shapes, inverse: dict[str, str], copies: list):
    """An MTP layer's tensor under the checkpoint's names (layer L + i); its `enorm` adds to `copies`
    the layer's copies of the embedding and head, which the stream's end yields."""
    prefix = f"model.layers.{s.num_layers + i}."
    if suffix.startswith("transformer_layer."):
        yield from _layer_to_hf(prefix, suffix.removeprefix("transformer_layer."), t, s, inverse)
        return
    theirs = {v: k for k, v in _MTP_PLAIN.items()}
    if suffix not in theirs:
        raise KeyError(f"unmapped Megatron parameter mtp.layers.{i}.{suffix!r}")
    yield prefix + theirs[suffix], t
    if suffix == "enorm.weight":
        for own, model in _MTP_SHARED.items():
            copies.append(
                (prefix + own, "model.embed_tokens.weight" if s.tied and model == "lm_head.weight" else model)
            )


def _layer_to_hf(prefix: str, suffix: str, t: torch.Tensor, s: Shapes, inverse: dict[str, str]):
    if suffix in inverse:
        yield prefix + inverse[suffix], _rope_rows(suffix, t, s, inverse=True)
    elif suffix.startswith("self_attention.linear_qkv."):
        kind = suffix.rsplit(".", 1)[1]
        for p, part in zip("qkv", unpack_qkv(t, s), strict=True):
            yield f"{prefix}self_attn.{p}_proj.{kind}", part
    elif suffix == "mlp.linear_fc1.weight":
        gate, up = t.chunk(2, dim=0)
        yield prefix + "mlp.gate_proj.weight", gate
        yield prefix + "mlp.up_proj.weight", up
    elif suffix == "mlp.router.weight":
        yield prefix + "mlp.gate.weight", t
    elif suffix == "mlp.shared_experts.linear_fc1.weight":
        gate, up = t.chunk(2, dim=0)
        yield prefix + "mlp.shared_experts.gate_proj.weight", gate
        yield prefix + "mlp.shared_experts.up_proj.weight", up
    elif (m := _EXPERT.match(suffix)) is not None:
        expert = f"{prefix}mlp.experts.{m.group(1)}."
        if m.group(2) == "linear_fc1.weight":
            gate, up = t.chunk(2, dim=0)
            yield expert + "gate_proj.weight", gate
            yield expert + "up_proj.weight", up
        else:
            yield expert + "down_proj.weight", t
    else:
        raise KeyError(f"unmapped Megatron parameter {prefix}{suffix!r}")


def _suffix(name: str) -> str:
    """The per-layer part of a Megatron name; an expert's linear reads as the dense MLP's (same
    tensor-parallel split)."""
    m = _LAYER.match(name)
    suffix = m.group(2) if m else name
    e = _EXPERT.match(suffix)
    return f"mlp.{e.group(2)}" if e else suffix


def expert_of(name: str) -> int | None:
    """Expert index inside a Megatron expert weight's name (None for any other weight)."""
    m = _EXPERT_NAME.match(name)
    return int(m.group(2)) if m else None


def with_expert(name: str, expert: int) -> str:
    """The same expert weight's name with another expert index (local <-> global numbering)."""
    m = _EXPERT_NAME.match(name)
    assert m is not None, f"{name} is not an expert weight"
    return f"{m.group(1)}{expert}{m.group(3)}"


def ep_to_global(name: str, ep_rank: int, local_experts: int) -> str:
    """Expert-parallel rank `ep_rank`'s local expert l is global expert ep_rank * local_experts + l."""
    e = expert_of(name)
    return name if e is None else with_expert(name, ep_rank * local_experts + e)


def tp_shard(name: str, full: torch.Tensor, rank: int, size: int, s: Shapes) -> torch.Tensor:
    """The slice of a full Megatron tensor that tensor-parallel rank `rank` of `size` holds."""
    suffix = _suffix(name)
    dim = _TP_DIM.get(suffix)
    if dim is None or size == 1 or (s.te_names and suffix in _MLA_DUPLICATED_UNDER_TE):
        return full
    if suffix == "mlp.linear_fc1.weight":
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size)[rank], up.chunk(size)[rank]], dim=0)
    if suffix.startswith("self_attention.linear_qkv."):
        groups = full.reshape(s.num_kv_heads, -1, *full.shape[1:])
        return groups.chunk(size)[rank].reshape(-1, *full.shape[1:])
    return full.chunk(size, dim=dim)[rank]


def tp_unshard(name: str, shards: list[torch.Tensor], s: Shapes) -> torch.Tensor:
    """Inverse of tp_shard: the full tensor from every rank's slice, in rank order."""
    suffix = _suffix(name)
    dim = _TP_DIM.get(suffix)
    if dim is None or len(shards) == 1 or (s.te_names and suffix in _MLA_DUPLICATED_UNDER_TE):
        return shards[0]
    if suffix == "mlp.linear_fc1.weight":
        halves = [sh.chunk(2, dim=0) for sh in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=dim)


def ep_shard(full: dict[str, torch.Tensor], ep_rank: int, ep_size: int, s: Shapes) -> dict[str, torch.Tensor]:
    """The part of a full Megatron state dict that expert-parallel rank `ep_rank` holds: every
    non-expert weight, and its E/ep_size experts renumbered from 0."""
    local = s.num_experts // ep_size if s.num_experts else 0
    out = {}
    for name, t in full.items():
        e = expert_of(name)
        if e is None:
            out[name] = t
        elif ep_rank * local <= e < (ep_rank + 1) * local:
            out[with_expert(name, e - ep_rank * local)] = t
    return out


def to_local(name: str, layer_offset: int) -> str:
    """Global layer number -> the number a pipeline stage starting at layer_offset uses."""
    m = _LAYER.match(name)
    return f"decoder.layers.{int(m.group(1)) - layer_offset}.{m.group(2)}" if m else name


def to_global(name: str, layer_offset: int) -> str:
    """Inverse of to_local."""
    m = _LAYER.match(name)
    return f"decoder.layers.{int(m.group(1)) + layer_offset}.{m.group(2)}" if m else name


def layer_of(name: str) -> int | None:
    """Global layer index of a Megatron name (None for embedding, final norm, output layer)."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None
