"""The embedded engine's DeepSeek-V4 decoder (Flash and Pro): hyper-connections around hybrid attention
and hash / top-k routed experts. transformers' DeepseekV4ForCausalLM is the reference.

Maths (per layer; x: `hc_mult` = N residual streams [N, hidden] per token):
    mHC(x):  f = W_fn RMS(flatten x)  (fp32, unweighted RMS over N*hidden), split [pre N; post N; comb N*N]
             pre = sigmoid(a_pre f_pre + b_pre) + eps,  post = 2 sigmoid(a_post f_post + b_post),
             comb = Sinkhorn(softmax_rows(a_comb f_comb + b_comb) + eps)  (columns, then rows and columns
             `hc_sinkhorn_iters` - 1 more times),  collapsed = sum_j pre_j x_j
    x <- post (x) Attn(RMSNorm(collapsed)) + comb^T x,  then the same around the MoE
    logits = W_head RMSNorm(sum_j pre_j x_j)   (the head's own mHC collapse: `hc_head`)
MoE: a shared expert plus routed experts whose weights are sqrtsoftplus(W_gate x) at the chosen
experts, normalised, times `routed_scaling_factor`; the choice is a frozen token -> experts table
(`tid2eid`, the first `hash_moe` layers) or the top-k of the scores plus a correction bias; every
expert clamps its gate to <= `swiglu_limit` and its up to [-limit, limit] before silu(gate) * up.
Routed experts are recorded for every layer (SGLang's layout): a hash layer's are the table's, which
the token id alone fixes, so the trainer replays only the top-k layers (miles/train/routing_replay.py).

Weights are held under transformers' in-memory names (what the trainers push); a checkpoint's
DeepSeek names (`layers.N.attn.wq_a.weight`, `ffn.experts.E.w1.weight`, `hc_attn_fn`, ...) are renamed
at load (miles/models/families/deepseek_v4.py `hf_name`). The norms, hyper-connection and sink
parameters, position and correction biases stay in fp32 and the hash table in int64, as transformers
keeps them. Not yet: FP8 and LoRA on this model, the CUDA fused forward, MTP layers (dropped at load).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from miles.engine import hyper_connections as hc
from miles.engine import moe
from miles.engine.hybrid_attention import HybridAttention
from miles.engine.model import Decoder
from miles.engine.rope import frequencies
from miles.engine.spec import Batch
from miles.engine.v4_spec import V4Spec

_FP32_LEAVES = tuple(
    "." + leaf
    for leaf in (
        "fn",
        "base",
        "scale",
        "hc_fn",
        "hc_base",
        "hc_scale",
        "sinks",
        "position_bias",
        "e_score_correction_bias",
        "q_a_norm.weight",
        "kv_norm.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
    )
) + ("model.norm.weight",)
"""What transformers keeps in fp32 whatever the model dtype (`_keep_in_fp32_modules_strict`)."""


def hyper_mixes(post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """[..., N + N*N]: a hyper-connection's post and comb weights side by side, as one traced output."""
    return torch.cat((post, comb.flatten(-2)), dim=-1)


class V4Decoder(Decoder):
    """A Decoder whose forward is DeepSeek-V4's (module docstring); the pool is HybridAttention's."""

    def __init__(self, spec, weights: dict[str, torch.Tensor], device: str, dtype: torch.dtype):
        from miles.models.families.deepseek_v4 import hf_names

        self.v4: V4Spec = spec.v4
        self.hybrid = HybridAttention(self, spec.v4)
        super().__init__(spec, hf_names(weights), device, dtype)
        self.paged_decode = self.fused = self.row_decode = False
        m = self.v4
        self.freqs, self.rope_scales = {}, {}
        for kind, theta in m.rope_theta.items():
            inv, scale = frequencies(m.rope[kind], m.rope_dim, theta, m.max_positions, m.rope_truncate)
            self.freqs[kind], self.rope_scales[kind] = inv.to(self.device), scale

    def _allocate(self, weights: dict[str, torch.Tensor]) -> None:
        names = self.expected_names()
        ours = {n: torch.float32 for n in names if n.endswith(_FP32_LEAVES)}
        ours |= {n: torch.int64 for n in names if n.endswith(".tid2eid")}
        self._dtypes = ours | self._dtypes  # an FP8 engine's storage dtypes (set before) win
        super()._allocate(weights)

    def load(self, weights: dict[str, torch.Tensor], strict: bool = False) -> None:
        from miles.models.families.deepseek_v4 import hf_names

        super().load(hf_names(weights), strict)

    def expected_names(self) -> list[str]:
        s, m = self.spec, self.v4
        names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
        names += [f"model.hc_head.{n}" for n in ("hc_fn", "hc_base", "hc_scale")]
        for i in range(s.num_layers):
            p = f"model.layers.{i}."
            names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
            names += [f"{p}{hc}.{n}" for hc in ("attn_hc", "ffn_hc") for n in ("fn", "base", "scale")]
            names += m.attention_names(i)
            names += s.moe.expert_names(i)
        return names

    def _fused_groups(self) -> dict[str, list[str]]:
        groups: dict[str, list[str]] = {}
        for i in self.spec.moe.sparse_layers:
            groups.update(self.spec.moe.stacked_groups(i))
        return groups

    def new_kv_pool(self, num_slots: int):
        self.new_routing_table(num_slots)
        return self.hybrid.new_pool(num_slots)

    def v4_norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """transformers' V4 RMSNorm: in fp32 with its fp32 weight, rounded once to x's dtype."""
        w = self.params[name]
        return (w.float() * F.rms_norm(x.float(), (x.shape[-1],), eps=self.v4.eps)).to(x.dtype)

    def rope_at(self, positions: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [T, rope_dim / 2] of the `kind` ("main" / "compress") rope, in the model dtype."""
        freqs = positions.float()[:, None] * self.freqs[kind][None, :]
        s = self.rope_scales[kind]
        return (freqs.cos() * s).to(self.dtype), (freqs.sin() * s).to(self.dtype)

    def _hyper(self, x: torch.Tensor, p: str, module: str):
        """mHC weights of the streams x [T, N, hidden]: (post [T, N], comb [T, N, N], collapsed [T, hidden]);
        traced under `module` as [post; comb] (the alignment tool's hyper_mixes)."""
        m = self.v4
        w = (self.params[p + "fn"], self.params[p + "base"], self.params[p + "scale"])
        pre, post, comb = hc.mixes(x, *w, m.hc_sinkhorn_iters, m.hc_eps, m.eps)
        if self.trace is not None:
            self.trace[module] = hyper_mixes(post, comb)
        return post, comb, hc.collapse(pre, x)

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """The final collapse of the streams (`model.hc_head`)."""
        w = (self.params[f"model.hc_head.hc_{k}"] for k in ("fn", "base", "scale"))
        return hc.collapse(hc.head_weights(x, *w, self.v4.hc_eps, self.v4.eps), x)

    def _mlp(self, i: int, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        p, m = f"model.layers.{i}.mlp.", self.spec.moe
        gate_up = self._stacked(p + "experts.gate_up_proj").view(m.num_experts, 2 * m.intermediate_size, -1)
        down = self._stacked(p + "experts.down_proj").view(m.num_experts, -1, m.intermediate_size)
        table = self.params[p + "gate.tid2eid"][token_ids] if i in m.hash_layers else None
        bias = self.params.get(p + "gate.e_score_correction_bias")
        out, ids = moe.sparse_mlp(x, self.params[p + "gate.weight"], gate_up, down, m, bias, table)
        if self.record_routing:
            self._routed.append(ids)
        return out + self._shared(x, p + "shared_experts.")

    def _shared(self, x: torch.Tensor, p: str) -> torch.Tensor:
        """The shared expert: its gate and up clamped by `swiglu_limit` like the routed experts'."""
        limit = self.spec.moe.swiglu_limit
        gate = self._project(x, p + "gate_proj.weight").clamp(max=limit)
        up = self._project(x, p + "up_proj.weight").clamp(min=-limit, max=limit)
        return self._project(F.silu(gate) * up, p + "down_proj.weight")

    @torch.inference_mode()
    def forward(self, b: Batch, pool) -> torch.Tensor:
        """Logits (fp32) at each request's last new token: [B, vocab]. Writes the new tokens' caches."""
        N = self.v4.hc_mult
        emb = self.params["model.embed_tokens.weight"][b.input_ids]
        x = emb[:, None, :].expand(-1, N, -1).contiguous()
        for i in range(self.spec.num_layers):
            p = f"model.layers.{i}."
            post, comb, collapsed = self._hyper(x, p + "attn_hc.", p + "attn_hc")
            h = self._traced(p + "input_layernorm", self.v4_norm(collapsed, p + "input_layernorm.weight"))
            out = self._traced(p + "self_attn", self.hybrid.forward(i, h, b, pool[i]))
            x = hc.mix(post, comb, out, x)
            post, comb, collapsed = self._hyper(x, p + "ffn_hc.", p + "ffn_hc")
            h = self.v4_norm(collapsed, p + "post_attention_layernorm.weight")
            h = self._traced(p + "post_attention_layernorm", h)
            x = hc.mix(post, comb, self._traced(p + "mlp", self._mlp(i, h, b.input_ids)), x)
        self._take_routing(b.write_slots)
        final = self.v4_norm(self._head(x), "model.norm.weight")
        if self.trace is not None:
            self.trace["model.norm"] = final
        return self._logits(final[b.last_index], b.last_index)
