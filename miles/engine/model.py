"""The embedded engine's decoder: the Llama / Qwen2 / Qwen3 family over a token-slot KV cache.

Maths (per layer, pre-norm):
    h   = x + W_o · Attn(RoPE(q), RoPE(k), v),   q,k,v = W_{q,k,v} · RMSNorm(x) (+ bias for Qwen2)
    out = h + W_down · (silu(W_gate · RMSNorm(h)) * (W_up · RMSNorm(h)))
    RMSNorm(x) = w * x / sqrt(mean(x^2) + eps)        (Qwen3 also normalises q and k per head)
    RoPE: rotate pairs (i, i + d/2) by angle pos * theta^(-2i/d)   (the "rotate_half" layout of HF)
    Attn: softmax(q k^T / sqrt(d)) v with grouped-query heads (each kv head serves H/KVH q heads).

The KV cache is a flat pool of token slots per layer ([kv_heads, slots, head_dim]); a request owns
the list of slots of its tokens, so no memory is spent on padding and requests sharing a prefix
share slots. One forward runs a whole batch: the new tokens of every request packed together
(decode: one token each), keys gathered from the pool into a padded [batch, context] view for one
scaled-dot-product-attention call. Grouped-query heads are folded into the query length: the G = H/KVH
query heads of kv head j attend as G*Q queries of one (request, j) pair, so K/V are never repeated
per query head and no fused kernel is ruled out by a GQA restriction. The forward has no host
synchronisation and no data-dependent shapes, so a decode step can be captured in a CUDA graph.

CPU decode reads keys in place from each request's row of a dense per-request cache instead
(`forward_rows`, miles/engine/row_decode.py).

CUDA runs a layer in about ten kernels (a decode step's time is set by its kernel count): a layer's
q/k/v weights (and biases) are stored as one [q; k; v] tensor and its gate/up weights as one
[gate; up] tensor, the HF-named weights being views into them, so each is one GEMM; Triton kernels
(miles/engine/triton_fused.py) fuse the fp32 residual add with the next RMSNorm, RoPE with the K/V
pool write, and silu(gate) * up, with the roundings of the per-op path (`Decoder.fused = False`);
that forward is miles/engine/fused_forward.py.
Qwen3-MoE: sparse layers run the router + experts of miles/engine/moe.py in place of the MLP (its
docstring has the maths and the expert storage); with `record_routing` set, a forward leaves each
token's top-k expert ids per sparse layer in `routing` ([T, sparse layers, k], narrow ints) and
scatters them into `routing_table` at the tokens' pool slots (made with the KV pool), so a prefix
served from the cache still has its routing; `read_routing` reads a request's rows at its finish.
Left out: rope scaling variants (llama3/yarn), sliding window, shared experts, tensor parallelism.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from miles.engine import moe, row_decode
from miles.engine.fused_forward import FusedForward
from miles.engine.invariant_forward import InvariantForward
from miles.engine.kv_cache import gather_slots as _gather_slots
from miles.engine.mla import LatentAttention
from miles.engine.packing import to_tokens
from miles.engine.rope import decoder_frequencies
from miles.engine.sdpa import masked_sdpa
from miles.engine.spec import Batch, ModelSpec, load_weights

__all__ = ["Batch", "Decoder", "ModelSpec", "load_weights"]


class Decoder:
    """Weights by HF name plus a forward over a Batch; the KV pool is owned by the caller.

    Storage: each layer's q/k/v weights (and biases) are rows of one fused `qkv_proj` tensor, its
    gate/up weights rows of one `gate_up_proj` tensor, so the CUDA forward runs one GEMM for each;
    `params` maps every HF name to its tensor, a view into the fused one for those. Weight updates
    copy into the existing tensors by name, so anything that captured their addresses (CUDA graphs)
    sees the new values. `offload()` moves the weights to pinned host memory and `onload()` brings them
    back (new device tensors: captured graphs must be dropped across the pair).
    """

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], device: str, dtype: torch.dtype):
        self.spec = spec
        self.device = torch.device(device)
        self.dtype = dtype
        self.resident = True
        self.storage: dict[str, torch.Tensor] = {}
        """The tensors owning the weights' memory: fused ones by their fused name, the rest by HF name."""
        self.params: dict[str, torch.Tensor] = {}
        self._fused: dict[str, list[tuple[str, int]]] = {}  # fused name -> (HF name, rows) stacked in it
        self._host: dict[str, torch.Tensor] = {}  # pinned buffers, reused by every offload
        self.latent = LatentAttention(self, spec.mla) if spec.mla is not None else None
        """The attention of a model with multi-head latent attention (miles/engine/mla.py), else None."""
        self.paged_decode = self.device.type == "cuda" and self.latent is None
        """CUDA decode attention reads K/V in place from the pool (Triton kernel) instead of gathering."""
        self.fused = self.device.type == "cuda" and self.latent is None
        self.row_decode = self.device.type == "cpu" and self.latent is None
        """CPU decode may read the scheduler's RowKV rows (`forward_rows`): grouped-query K/V only."""
        """The CUDA forward runs the fused GEMMs and the Triton kernels of triton_fused.py; False runs
        the per-op path (the CPU forward's), one GEMM per HF weight."""
        self.fused_forward = FusedForward(self)
        """The forward strategy of CUDA tensors when `fused` (miles/engine/fused_forward.py)."""
        self.invariant: InvariantForward | None = None
        """Deterministic inference's forward (miles/engine/invariant_forward.py): all forwards when set."""
        self.capture_hidden = False
        """When set, each forward leaves the final-normed hidden states of all its new tokens [T, hidden]
        in `hidden` (the MTP draft's input, miles/engine/mtp.py)."""
        self.hidden: torch.Tensor | None = None
        self.trace: dict[str, torch.Tensor] | None = None
        """When a dict, the per-op forward leaves each sublayer's output [T, hidden] in it under its
        transformers module name (`model.layers.3.self_attn`): the alignment tool's side (miles/align.py)."""
        self.record_routing = False
        """MoE: each forward leaves the top-k expert ids of its tokens in `routing`."""
        self.routing: torch.Tensor | None = None
        """[T, sparse layers, k] expert ids of the last forward's packed tokens (record_routing)."""
        self.routing_table: torch.Tensor | None = None
        """[pool slots, sparse layers, k] expert ids of the token whose K/V is in each slot (record_routing)."""
        self._routed: list[torch.Tensor] = []
        self._dtypes: dict[str, torch.dtype] = {}  # storage dtypes other than `dtype` (FP8 weights, scales)
        self.lora = None
        """The LoRA adapter bank (miles/engine/lora.py: LoraBank), None without --enable-lora."""
        self.wide: dict[str, torch.Tensor] = {}
        """Stored name -> the tensor its storage is the top rows of, where `widen` stacked the LoRA
        bank's A under a weight (and zeros under its bias)."""
        self._narrow: dict[str, int] = {}  # rows of each widened stored tensor
        self.load(weights, strict=True)
        self.inv_freq, self.rope_scale = decoder_frequencies(spec, self.device)
        """RoPE's inverse frequencies, and YaRN's factor on cos and sin (1.0 for default RoPE)."""

    def make_invariant(self) -> None:
        """Every forward through the batch-invariant operations (grouped-query decoders, Qwen3-MoE)."""
        self.invariant = InvariantForward(self)
        self.fused = self.paged_decode = self.row_decode = False

    def expected_names(self) -> list[str]:
        s = self.spec
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not s.tie_word_embeddings:
            names.append("lm_head.weight")
        for i in range(s.num_layers):
            p = f"model.layers.{i}."
            names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
            if s.mla is not None:
                names += s.mla.attention_names(p)
            else:
                names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
            if s.moe is not None and i in s.moe.sparse_layers:
                names += s.moe.expert_names(i)
            else:
                names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
            names += s.family.attention_names(p)
        return names

    def _fused_groups(self) -> dict[str, list[str]]:
        """Fused name -> the HF names whose rows it stacks: per layer [q; k; v] weights (and biases)
        and [gate; up] weights."""
        known, groups = set(self.expected_names()), {}
        for i in range(self.spec.num_layers):
            p = f"model.layers.{i}."
            for sub, fused, parts in (("self_attn", "qkv", "qkv"), ("mlp", "gate_up", ("gate", "up"))):
                for kind in ("weight", "bias"):
                    members = [f"{p}{sub}.{x}_proj.{kind}" for x in parts]
                    if all(m in known for m in members):
                        groups[f"{p}{sub}.{fused}_proj.{kind}"] = members
            if self.spec.moe is not None and i in self.spec.moe.sparse_layers:
                groups.update(self.spec.moe.stacked_groups(i))
        return groups

    def _allocate(self, weights: dict[str, torch.Tensor]) -> None:
        """Empty storage shaped as a complete checkpoint, and the views of `params` into it."""
        home, dt = (self.device if self.resident else torch.device("cpu")), self._dtypes
        groups = self._fused_groups()
        self._fused = {f: [(m, weights[m].shape[0]) for m in ms] for f, ms in groups.items()}
        shapes = {n: weights[n].shape for n in self.expected_names()}
        for fused, members in groups.items():
            if len({shapes[m][1:] for m in members}) != 1:
                raise ValueError(f"{members} disagree in shape: {[tuple(shapes[m]) for m in members]}")
            shapes[fused] = (sum(rows for _, rows in self._fused[fused]), *shapes[members[0]][1:])
            for m in members:
                del shapes[m]
        self.storage = {
            n: torch.empty(s, dtype=dt.get(n, self.dtype), device=home) for n, s in shapes.items()
        }
        self._bind()

    def _bind(self) -> None:
        """`params` from `storage`: HF-named tensors as they are, fused members as row views; a widened
        tensor's storage is its top rows."""
        self.storage.update({k: w[: self._narrow[k]] for k, w in self.wide.items()})
        self.params = {n: t for n, t in self.storage.items() if n not in self._fused}
        for fused, members in self._fused.items():
            views = self.storage[fused].split([rows for _, rows in members])
            for (name, _), view in zip(members, views, strict=True):
                self.params[name] = view

    def widen(self, key: str, rows: int) -> torch.Tensor | None:
        """Stack `rows` zero rows under stored weight `key` (a plain or fused weight name; its bias gets
        zeros too) and return them: the LoRA bank keeps the layer's A there, so one GEMM yields x W^T
        and x A^T side by side (miles/engine/lora.py). The weight stays where `storage` and `params`
        point (views of the wider tensor). None where the weight is not a device-resident matrix."""
        w = self.storage.get(key)
        if w is None or w.dim() != 2 or not self.resident or w.dtype != self.dtype:
            return None
        for k in (key, key.removesuffix(".weight") + ".bias"):
            if (t := self.storage.get(k)) is not None:
                self.wide[k] = torch.zeros(t.shape[0] + rows, *t.shape[1:], dtype=t.dtype, device=t.device)
                self.wide[k][: t.shape[0]].copy_(t)
                self._narrow[k] = t.shape[0]
        self._bind()
        return self.stacked_rows(key)

    def stacked_rows(self, key: str) -> torch.Tensor:
        """The rows `widen` stacked under stored weight `key`, where its tensors are now."""
        return self.wide[key][self._narrow[key] :]

    def load(self, weights: dict[str, torch.Tensor], strict: bool = False) -> None:
        """Copy tensors in by HF name; unknown names or wrong shapes raise ValueError naming them."""
        if self.spec.mtp_layers:  # DeepSeek-V3's MTP layers follow the decoder's: not served
            mtp = tuple(f"model.layers.{self.spec.num_layers + k}." for k in range(self.spec.mtp_layers))
            weights = {n: t for n, t in weights.items() if not n.startswith(mtp)}
        if self.spec.moe is not None:  # stacked [E, ...] expert tensors arrive as their per-expert views
            weights = moe.per_expert(weights, self.spec.moe)
        known = set(self.expected_names())
        unknown = [n for n in weights if n not in known and not (n == "lm_head.weight")]
        if unknown:
            raise ValueError(f"unknown weight names for {self.spec.arch}: {unknown[:5]}")
        if strict and (missing := sorted(known - set(weights))):
            raise ValueError(f"checkpoint lacks weights: {missing[:5]}")
        if not self.storage:
            self._allocate(weights)
        for name, tensor in weights.items():
            old = self.params.get(name)
            if old is not None and tuple(old.shape) != tuple(tensor.shape):
                raise ValueError(f"shape of {name}: engine {tuple(old.shape)}, got {tuple(tensor.shape)}")
        for name, tensor in weights.items():
            if name == "lm_head.weight" and self.spec.tie_word_embeddings:
                continue
            self.params[name].copy_(tensor)

    def offload(self) -> None:
        """Move the weights to (pinned) host memory; the device memory is returned to the allocator."""
        if not self.resident:
            return
        pin = self.device.type == "cuda"
        owners = self._owners()
        if {k: v.shape for k, v in self._host.items()} != {k: v.shape for k, v in owners.items()}:
            self._host = {  # pinned allocation is slow: once per engine
                k: torch.empty(v.shape, dtype=v.dtype, pin_memory=pin) for k, v in owners.items()
            }
        for k, v in owners.items():
            self._host[k].copy_(v, non_blocking=pin)
        if pin:
            torch.cuda.current_stream(self.device).synchronize()
        self._own(dict(self._host))
        self.resident = False

    def onload(self) -> None:
        """Bring the weights back to the device (inverse of offload)."""
        if self.resident:
            return
        self._own({k: v.to(self.device, non_blocking=True) for k, v in self._owners().items()})
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.resident = True

    def _owners(self) -> dict[str, torch.Tensor]:
        """Each stored tensor's owner of memory: the wider tensor where `widen` stacked rows under it."""
        return {k: self.wide.get(k, v) for k, v in self.storage.items()}

    def _own(self, owners: dict[str, torch.Tensor]) -> None:
        """`storage`, `wide` and `params` from tensors shaped as `_owners` answers; the LoRA bank's A
        stacked under weights follows them."""
        self.wide = {k: owners[k] for k in self.wide}
        self.storage = dict(owners)
        self._bind()
        if self.lora is not None and self.wide:
            self.lora.rehome(lambda key: self.stacked_rows(key + ".weight"))

    def get(self, name: str) -> torch.Tensor:
        if name == "lm_head.weight" and self.spec.tie_word_embeddings:
            name = "model.embed_tokens.weight"
        if name not in self.params:
            raise KeyError(name)
        return self.params[name]

    def new_kv_pool(self, num_slots: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (keys, values), each [kv_heads, num_slots, head_dim]; with `record_routing`, a
        fresh routing table of as many slots beside it."""
        s = self.spec
        self.new_routing_table(num_slots)
        if self.latent is not None:
            return self.latent.new_pool(num_slots)
        shape = (s.num_kv_heads, num_slots, s.head_dim)
        mk = lambda: torch.zeros(shape, device=self.device, dtype=self.dtype)  # noqa: E731
        return [(mk(), mk()) for _ in range(s.num_layers)]

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # rms_norm computes in fp32 and rounds once to x's dtype, then the weight multiplies in that
        # dtype: HF's order of rounding, in one fused kernel where PyTorch has one
        return weight * F.rms_norm(x, (x.shape[-1],), eps=self.spec.rms_norm_eps)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return (x * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)

    def _decode_mask(self, b: Batch) -> torch.Tensor | None:
        """The folded mask, or None when attention reads the pool in place (one query per request on CUDA)."""
        if self.paged_decode and b.query_index.shape[1] == 1 and b.input_ids.is_cuda:
            return None
        return self._fold_mask(b)

    def _fold_mask(self, b: Batch) -> torch.Tensor:
        """[KVH*B, 1, G*Qmax, Lmax] additive mask (0 or -inf, built once per forward, not per layer):
        query (g, j) of request r sees keys 0..query_pos[r, j]."""
        s = self.spec
        B, Q = b.query_pos.shape
        group = s.num_heads // s.num_kv_heads
        key_pos = torch.arange(b.context_slots.shape[1], device=b.query_pos.device)
        mask = key_pos[None, None, :] <= b.query_pos.clamp(min=0)[:, :, None]
        mask = mask[None, :, None].expand(s.num_kv_heads, B, group, Q, mask.shape[-1])
        mask = mask.reshape(s.num_kv_heads * B, 1, group * Q, -1)
        return torch.zeros(mask.shape, dtype=self.dtype, device=mask.device).masked_fill_(
            ~mask, float("-inf")
        )

    def _qkv(self, i: int, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, D], k and v [T, KVH, D] of layer i, RoPE applied (and Qwen3's q/k norms)."""
        s, p = self.spec, f"model.layers.{i}.self_attn."
        T, KVH, D = x.shape[0], s.num_kv_heads, s.head_dim
        q = self._project(x, p + "q_proj.weight", self.params.get(p + "q_proj.bias"))
        k = self._project(x, p + "k_proj.weight", self.params.get(p + "k_proj.bias"))
        v = self._project(x, p + "v_proj.weight", self.params.get(p + "v_proj.bias"))
        q, k, v = q.view(T, s.num_heads, D), k.view(T, KVH, D), v.view(T, KVH, D)
        if s.family.qk_norm:
            w = self.params
            q, k = self._norm(q, w[p + "q_norm.weight"]), self._norm(k, w[p + "k_norm.weight"])
        return self._rope(q, cos, sin), self._rope(k, cos, sin), v

    def _attention(self, i: int, x: torch.Tensor, b: Batch, cos, sin, pool, mask) -> torch.Tensor:
        if self.latent is not None:
            return self.latent.forward(i, x, b, cos, sin, pool, mask)
        q, k, v = self._qkv(i, x, cos, sin)
        k_pool, v_pool = pool[i]
        k_pool[:, b.write_slots] = k.transpose(0, 1)
        v_pool[:, b.write_slots] = v.transpose(0, 1)
        return self._project(self._attend(q, b, pool[i], mask), f"model.layers.{i}.self_attn.o_proj.weight")

    def _attend(self, q: torch.Tensor, b: Batch, kv: tuple[torch.Tensor, torch.Tensor], mask) -> torch.Tensor:
        """Attention [T, H*D] of the packed queries q [T, H, D] over the pool (the new K/V written)."""
        s = self.spec
        T, (B, Q) = q.shape[0], b.query_index.shape
        KVH, D, G = s.num_kv_heads, s.head_dim, s.num_heads // s.num_kv_heads
        k_pool, v_pool = kv
        if mask is None:  # CUDA decode: one query per request, K/V read in place from the pool
            from miles.engine.triton_attention import paged_decode_attention

            out = paged_decode_attention(q, k_pool, v_pool, b.context_slots, b.positions, D**-0.5)
            return out.view(T, s.num_heads * D)
        L = b.context_slots.shape[1]
        # [KVH*B, 1, L, D] keys/values (a gather, contiguous) and [KVH*B, 1, G*Q, D] folded queries
        kb = _gather_slots(k_pool, b.context_slots).view(KVH * B, 1, L, D)
        vb = _gather_slots(v_pool, b.context_slots).view(KVH * B, 1, L, D)
        qb = q[b.query_index].view(B, Q, KVH, G, D).permute(2, 0, 3, 1, 4).reshape(KVH * B, 1, G * Q, D)
        out = masked_sdpa(qb, kb, vb, mask)
        out = out.view(KVH, B, G, Q, D).permute(1, 3, 0, 2, 4).reshape(B * Q, s.num_heads * D)
        return to_tokens(out, b, T)

    @torch.inference_mode()
    def forward_rows(
        self,
        d: Batch,
        pool: list[tuple[torch.Tensor, torch.Tensor]],
        rows: list[tuple[torch.Tensor, torch.Tensor]],
        row_span: int,
        prefill: Batch | None = None,
    ) -> torch.Tensor:
        """CPU: logits [P + B, vocab] of a decode step over RowKV rows, with the prompts of `prefill`
        riding along (miles/engine/row_decode.py)."""
        return row_decode.forward_rows(self, d, pool, rows, row_span, prefill)

    def _mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        p = f"model.layers.{i}.mlp."
        m = self.spec.moe
        if m is not None and i in m.sparse_layers:
            gate_up = self._stacked(p + "experts.gate_up_proj").view(
                m.num_experts, 2 * m.intermediate_size, -1
            )
            down = self._stacked(p + "experts.down_proj").view(m.num_experts, -1, m.intermediate_size)
            bias = self.params.get(p + "gate.e_score_correction_bias")
            out, ids = moe.sparse_mlp(x, self.params[p + "gate.weight"], gate_up, down, m, bias)
            if self.record_routing:
                self._routed.append(ids)
            if m.shared_intermediate:
                out = out + self._dense_mlp(x, p + "shared_experts.")
            return out
        return self._dense_mlp(x, p)

    def _dense_mlp(self, x: torch.Tensor, p: str) -> torch.Tensor:
        """W_down (silu(W_gate x) * W_up x) of the MLP whose weights are named `p` + {gate,up,down}_proj."""
        gate, up = self._project(x, p + "gate_proj.weight"), self._project(x, p + "up_proj.weight")
        return self._project(F.silu(gate) * up, p + "down_proj.weight")

    def _stacked(self, name: str) -> torch.Tensor:
        """A sparse layer's stacked expert tensor (`mlp.experts.gate_up_proj` / `down_proj`) as the
        forward multiplies it; packed engines answer their dequantised copy."""
        return self.storage[name]

    def _has_fused(self, name: str) -> bool:
        """Whether the fused weight `name` (a dense layer's gate_up_proj) can be multiplied in one GEMM."""
        return name in self.storage

    _FUSED_MEMBERS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

    def _project(self, x: torch.Tensor, name: str, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`_linear` plus, with LoRA adapters (miles/engine/lora.py), each token's adapter term; a fused
        weight (qkv_proj, gate_up_proj) gets its members' terms side by side."""
        if self.lora is None:
            return self._linear(x, name, bias)
        module = name.removesuffix(".weight")
        if self.lora.terms.stacks(module):  # one GEMM yields [x W^T | x A^T] (widen), one kernel the rest
            wide_bias = None if bias is None else self.wide[module + ".bias"]
            return self.lora.terms.split(F.linear(x, self.wide[name], wide_bias), module)
        y = self._linear(x, name, bias)
        head, _, leaf = module.rpartition(".")
        members = self._FUSED_MEMBERS.get(leaf)
        if members is None:
            self.lora.terms.add(y, x, module)
            return y
        if self.lora.terms.add_fused(y, x, module):  # one GEMM pair for all members
            return y
        deltas = [self.lora.terms.delta(x, f"{head}.{m}") for m in members]
        if all(d is None for d in deltas):
            return y
        parts = [
            d if d is not None else x.new_zeros(*x.shape[:-1], self.lora.shapes[f"{head}.{m}"][0])
            for m, d in zip(members, deltas, strict=True)
        ]
        return y + torch.cat(parts, dim=-1)

    def _linear(self, x: torch.Tensor, name: str, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T (+ bias) for the weight stored as `name` (HF or fused); FP8 engines override it."""
        return F.linear(x, self.storage[name] if name in self._fused else self.params[name], bias)

    @torch.inference_mode()
    def forward(self, b: Batch, pool: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Logits (fp32) at each request's last new token: [B, vocab]. Writes the new K/V to the pool."""
        if self.invariant is not None:
            return self.invariant.forward(b, pool)
        if self.lora is not None:  # no slots: every token runs the base model, no adapter term at all
            self.lora.terms.begin(b.lora_slots)
        if self.fused and b.input_ids.is_cuda:
            return self.fused_forward.forward(b, pool)
        x = self.embed(b)
        # bf16 on CUDA: the residual stream stays fp32 (each sublayer's input is rounded once), which
        # roughly halves the log-prob error against an fp32 forward for a few elementwise kernels
        wide = x.is_cuda and x.dtype != torch.float32
        x = x.float() if wide else x
        freqs = b.positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        cos, sin = emb.cos(), emb.sin()
        if self.rope_scale != 1.0:
            cos, sin = cos * self.rope_scale, sin * self.rope_scale
        mask = self._decode_mask(b)
        for i in range(self.spec.num_layers):
            p = f"model.layers.{i}."
            h = self._traced(p + "input_layernorm", self._norm(x, self.params[p + "input_layernorm.weight"]))
            x = x + self._traced(
                p + "self_attn", self._attention(i, h.to(self.dtype), b, cos, sin, pool, mask)
            )
            h = self._norm(x, self.params[p + "post_attention_layernorm.weight"])
            h = self._traced(p + "post_attention_layernorm", h)
            x = x + self._traced(p + "mlp", self._mlp(i, h.to(self.dtype)))
        self._take_routing(b.write_slots)
        if self.trace is not None or self.capture_hidden:
            normed = self._norm(x, self.params["model.norm.weight"]).to(self.dtype)
            self.hidden = normed if self.capture_hidden else None
            if self.trace is not None:
                self.trace["model.norm"] = normed
            return self._logits(normed[b.last_index], b.last_index)
        return self._logits(
            self._norm(x[b.last_index], self.params["model.norm.weight"]).to(self.dtype), b.last_index
        )

    def embed(self, b: Batch) -> torch.Tensor:
        """The new tokens' input rows: their embeddings, or the batch's own `input_embeds` (MTP draft)."""
        return (
            self.params["model.embed_tokens.weight"][b.input_ids]
            if b.input_embeds is None
            else b.input_embeds
        )

    def _traced(self, module: str, out: torch.Tensor) -> torch.Tensor:
        """`out`, kept in `trace` under its transformers module name when tracing."""
        if self.trace is not None:
            self.trace[module] = out
        return out

    def new_routing_table(self, num_slots: int) -> None:
        """With `record_routing`, a zeroed `routing_table` beside a KV pool of `num_slots` slots."""
        m = self.spec.moe
        if not self.record_routing or m is None:
            self.routing_table = None
            return
        shape = (num_slots, len(m.sparse_layers), m.top_k)
        self.routing_table = torch.zeros(shape, dtype=m.record_dtype(), device=self.device)

    def _take_routing(self, slots: torch.Tensor) -> None:
        """`routing` from the ids the sparse layers of this forward recorded, also written to the
        routing table at the tokens' pool slots (a device scatter: no host sync, graph-safe)."""
        if self.record_routing and self._routed:
            self.routing = torch.stack(self._routed, dim=1).to(self.spec.moe.record_dtype())
            if self.routing_table is not None:
                self.routing_table[slots] = self.routing
        self._routed = []

    def read_routing(self, slots: list[int]) -> torch.Tensor:
        """int32 [len(slots), num_layers, k] expert ids of the tokens in `slots`, on the host; dense
        layers' rows are 0 (as SGLang's zero-initialised capture buffer). Waits for the device."""
        m = self.spec.moe
        out = torch.zeros(len(slots), self.spec.num_layers, m.top_k, dtype=torch.int32)
        if slots and self.routing_table is None:
            raise RuntimeError(
                "routes were asked for but none were recorded: set Decoder.record_routing before the KV "
                "pool is made (the server's --enable-return-routed-experts does)"
            )
        if slots:
            index = torch.tensor(slots, device=self.routing_table.device)
            out[:, list(m.sparse_layers)] = self.routing_table[index].cpu().to(torch.int32)
        return out

    def _logits(self, x: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits of the hidden states `x`, which are the forward's tokens `rows` (None: all of
        them, in order), for the LoRA adapters' lm_head term."""
        head = self.get("lm_head.weight")
        if x.is_cuda and x.dtype != torch.float32:  # logits kept in fp32, not rounded to bf16
            logits = torch.mm(x, head.t(), out_dtype=torch.float32)
        else:
            logits = F.linear(x, head).float()
        delta = None if self.lora is None else self.lora.terms.delta(x, "lm_head", rows)
        return logits if delta is None else logits + delta.float()
