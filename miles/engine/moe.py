"""The engine's mixture-of-experts layer: the sparse MLPs of Qwen3-MoE and DeepSeek-V3 (router + experts).

Maths (one token x [H], E experts, top-k), as transformers' Qwen3MoeSparseMoeBlock:
    p   = softmax(W_gate x)                      in fp32 over the E router logits
    S   = top-k indices of p,  w_e = p_e for e in S   (w /= sum(w) when norm_topk_prob), cast to x's dtype
    out = sum_{e in S} w_e * W_down[e] (silu(W_g[e] x) * (W_u[e] x))
Layer i is sparse when it is not in `mlp_only_layers` and (i + 1) % decoder_sparse_step == 0; the
others keep the dense MLP of the decoder (miles/engine/model.py).
DeepSeek-V3's router (`scoring` "sigmoid", as DeepseekV3TopkRouter) in fp32:
    p = sigmoid(W_gate x),  c = p + b  (b: the correction bias, for the choice only)
    the `topk_group` best of `n_group` expert groups by the sum of each group's two best c, then
    S = top-k of c within them,  w_e = p_e / sum_S p  (norm_topk_prob)  * routed_scaling_factor
and a shared expert (an MLP of width `shared_intermediate`) adds to every token's output. Its sparse
layers are those from `first_k_dense_replace` on (every `moe_layer_freq`-th).
DeepSeek-V4's routers (`scoring` "sqrtsoftplus", `route_v4`): p = sqrt(softplus(W_gate x)) in x's dtype,
S = the token's row of a frozen table on `hash_layers`, else the top-k of p + b; w as V3's; every
expert clamps gate <= `swiglu_limit` and up to [-limit, limit] before silu(gate) * up.

Storage: a sparse layer's experts live in two stacked tensors, `mlp.experts.gate_up_proj` [E, 2I, H]
(expert e's gate rows, then its up rows) and `mlp.experts.down_proj` [E, H, I] — transformers' own
in-memory layout — and the per-expert HF names of checkpoints (`mlp.experts.E.{gate,up,down}_proj.weight`,
what `save_pretrained` writes and published checkpoints hold) are views into them. Loading accepts
either naming.

Four exact expert paths, one result:
  - `experts_fused`: the rows sorted by expert in block-aligned ranges and one Triton launch per
    projection (miles/engine/triton_moe.py): no host synchronisation, shapes fixed by T*k, so decode
    steps are captured in CUDA graphs. The CUDA path (`CUDA_PATH`).
  - `experts_looped`: tokens sorted by expert, one GEMM pair per expert hit (host-synchronising: CPU).
  - `experts_grouped`: the same sorted layout through `torch._grouped_mm` with device offsets — no
    host synchronisation and no data-dependent shapes ([T*k] rows always), so a decode step runs
    inside a CUDA graph. The earlier CUDA path, kept as the fused kernels' anchor (bench/moe_gpu.py).
  - `experts_gathered`: each (token, slot) gathers its expert's weights and runs a batched matmul —
    also free of host syncs, the CUDA fallback for small batches (decode) without grouped GEMM.
Left out: Qwen2-MoE's gated shared expert, expert parallelism, the router's auxiliary loss
(training only).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from miles.models.families.deepseek_v3 import group_limited, sparse_layers

CUDA_PATH = "fused"
"""The expert path on CUDA: "fused" (Triton), "grouped" (torch._grouped_mm where it takes the shapes)
or "gathered"; the looped path takes what the chosen one cannot."""

GATHER_MAX_ROWS = 256
"""CUDA without grouped GEMM: the largest T*k the gathered path takes (each row copies one expert's
weights); larger batches (prefill) use the looped path."""


@dataclass(frozen=True)
class MoeSpec:
    """The mixture-of-experts shape of a Qwen3-MoE or DeepSeek-V3 config."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[int, ...]
    """The decoder layers whose MLP is sparse, ascending (the order of routed-expert records)."""
    scoring: str = "softmax"
    """The router: "softmax" (Qwen3-MoE) or "sigmoid" (DeepSeek-V3: correction bias, expert groups)."""
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_intermediate: int = 0
    """Width of the shared expert every token goes through (DeepSeek), 0 for none."""
    hash_layers: tuple[int, ...] = ()
    """DeepSeek-V4: the layers whose experts a frozen token -> experts table (`gate.tid2eid`) chooses."""
    swiglu_limit: float | None = None
    """DeepSeek-V4: every expert clamps gate to <= limit and up to [-limit, limit] before silu(gate) * up."""

    @classmethod
    def from_config(cls, cfg: dict, num_layers: int) -> MoeSpec:
        if "n_routed_experts" in cfg:
            return cls._deepseek(cfg, num_layers)
        # transformers 5 writes `num_local_experts`, published checkpoints `num_experts`
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        if experts <= 0:
            raise ValueError("Qwen3MoeForCausalLM config has no experts: set num_experts > 0 in config.json")
        top_k = _top_k(cfg, experts)
        if cfg.get("shared_expert_intermediate_size"):
            raise ValueError("shared experts (shared_expert_intermediate_size) are not supported")
        dense, step = set(cfg.get("mlp_only_layers") or []), int(cfg.get("decoder_sparse_step", 1))
        sparse = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
        return cls(experts, top_k, int(cfg["moe_intermediate_size"]), bool(cfg.get("norm_topk_prob")), sparse)

    @classmethod
    def _deepseek(cls, cfg: dict, num_layers: int) -> MoeSpec:
        experts = int(cfg["n_routed_experts"])
        groups, best = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
        if experts % groups or not 0 < best <= groups:
            raise ValueError(f"n_group={groups}, topk_group={best} do not split n_routed_experts={experts}")
        scoring = cfg.get("scoring_func", "sigmoid")
        if scoring not in ("sigmoid", "sqrtsoftplus"):
            raise ValueError(f"scoring_func {scoring!r} is not supported; known: sigmoid, sqrtsoftplus")
        v4 = cfg.get("model_type") == "deepseek_v4"
        kinds = cfg.get("mlp_layer_types") or []
        limit = cfg.get("swiglu_limit") if v4 else None
        return cls(
            experts,
            _top_k(cfg, experts),
            int(cfg["moe_intermediate_size"]),
            bool(cfg.get("norm_topk_prob", True)),
            tuple(sparse_layers(num_layers, cfg.get("first_k_dense_replace"), cfg.get("moe_layer_freq"))),
            scoring=scoring,
            n_group=groups,
            topk_group=best,
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            # V4's shared expert is one MLP of moe_intermediate_size (transformers' DeepseekV4MLP)
            shared_intermediate=int(cfg["moe_intermediate_size"])
            * (1 if v4 else int(cfg.get("n_shared_experts") or 0)),
            hash_layers=tuple(i for i, k in enumerate(kinds) if k == "hash_moe"),
            swiglu_limit=None if limit is None else float(limit),
        )

    def expert_names(self, layer: int) -> list[str]:
        """The per-expert HF names of a sparse layer, in the row order of the stacked tensors:
        gate_up stacks gate_0, up_0, gate_1, up_1, ...; down stacks down_0, down_1, ..."""
        p = f"model.layers.{layer}.mlp."
        names = [p + "gate.weight"]
        if layer in self.hash_layers:
            names.append(p + "gate.tid2eid")
        elif self.scoring != "softmax":
            names.append(p + "gate.e_score_correction_bias")
        if self.shared_intermediate:
            names += [f"{p}shared_experts.{x}_proj.weight" for x in ("gate", "up", "down")]
        for e in range(self.num_experts):
            names += [f"{p}experts.{e}.{x}_proj.weight" for x in ("gate", "up", "down")]
        return names

    def stacked_groups(self, layer: int) -> dict[str, list[str]]:
        """Stacked name -> the per-expert HF names whose rows it holds."""
        p = f"model.layers.{layer}.mlp.experts."
        E = range(self.num_experts)
        return {
            p + "gate_up_proj": [f"{p}{e}.{x}_proj.weight" for e in E for x in ("gate", "up")],
            p + "down_proj": [f"{p}{e}.down_proj.weight" for e in E],
        }

    def record_dtype(self) -> torch.dtype:
        """The narrowest integer dtype holding an expert id (routing records on the device)."""
        return (
            torch.uint8
            if self.num_experts <= 256
            else torch.int16
            if self.num_experts <= 32768
            else torch.int32
        )


def _top_k(cfg: dict, experts: int) -> int:
    top_k = int(cfg["num_experts_per_tok"])
    if not 0 < top_k <= experts:
        raise ValueError(f"num_experts_per_tok={top_k} must be in 1..num_experts={experts}")
    return top_k


def route(x: torch.Tensor, gate: torch.Tensor, top_k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in x's dtype, expert ids [T, k] int64) of the router W_gate [E, H]."""
    logits = F.linear(x, gate)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def route_grouped(
    x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, spec: MoeSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's router (module docstring): (weights [T, k] in x's dtype, expert ids [T, k])."""
    scores = F.linear(x.float(), gate.float()).sigmoid()
    choice = group_limited(scores + bias.float(), spec.n_group, spec.topk_group)
    ids = choice.topk(spec.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if spec.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return (weights * spec.routed_scaling_factor).to(x.dtype), ids


def route_v4(
    x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor | None, spec: MoeSpec, table: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4's routers (DeepseekV4TopKRouter / DeepseekV4HashRouter): scores sqrt(softplus(W_gate x))
    in x's dtype; the experts of the token's table row (hash layers) or the top-k of scores + bias; the
    weights the scores there, normalised, times routed_scaling_factor."""
    scores = F.softplus(F.linear(x, gate)).sqrt()
    ids = (
        table.long()
        if table is not None
        else torch.topk(scores + bias, spec.top_k, dim=-1, sorted=False).indices
    )
    weights = scores.gather(1, ids)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return (weights * spec.routed_scaling_factor).to(x.dtype), ids


def _sorted(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order, token of each sorted row, rows per expert) of the T*k (token, slot) pairs by expert
    (a stable sort: within an expert, rows keep token order)."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # a scatter, not bincount: CUDA's bincount reads the largest id back to the host
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )
    return order, order // ids.shape[1], counts


def _combine(x: torch.Tensor, y: torch.Tensor, weights: torch.Tensor, order: torch.Tensor | None = None):
    """sum over slots of weight * expert output [T, H], y [T*k, H] in (token, slot) order or, given
    `order`, in sorted order. Each product is rounded to x's dtype (as transformers' per-expert add),
    the k products summed in fp32 and rounded once: deterministic, unlike an atomic index_add."""
    T, k = weights.shape
    if order is not None:
        y = torch.empty_like(y).index_copy_(0, order, y)
    y = y.view(T, k, -1) * weights[..., None].to(y.dtype)
    return y.sum(dim=1, dtype=torch.float32).to(x.dtype) if k > 1 else y[:, 0].to(x.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """silu(gate) * up, gate clamped to <= limit and up to [-limit, limit] when a limit is given."""
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


def experts_looped(x, ids, weights, gate_up: torch.Tensor, down: torch.Tensor, limit=None) -> torch.Tensor:
    """The exact per-expert path: one [gate; up] GEMM and one down GEMM per expert hit."""
    order, tokens, counts = _sorted(ids, gate_up.shape[0])
    xs, outs, start = x[tokens], [], 0
    for e, n in enumerate(counts.tolist()):
        if n:
            gate, up = F.linear(xs[start : start + n], gate_up[e]).chunk(2, dim=-1)
            outs.append(F.linear(swiglu(gate, up, limit), down[e]))
        start += n
    return _combine(x, torch.cat(outs), weights, order)


def experts_grouped(x, ids, weights, gate_up: torch.Tensor, down: torch.Tensor, limit=None) -> torch.Tensor:
    """The sorted layout through grouped GEMMs with device offsets (no host sync, fixed shapes)."""
    order, tokens, counts = _sorted(ids, gate_up.shape[0])
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    gate, up = torch._grouped_mm(x[tokens], gate_up.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    y = torch._grouped_mm(swiglu(gate, up, limit), down.transpose(1, 2), offs=offs)
    return _combine(x, y, weights, order)


def experts_gathered(x, ids, weights, gate_up: torch.Tensor, down: torch.Tensor, limit=None) -> torch.Tensor:
    """Each (token, slot) row multiplies its own expert's gathered weights (no host sync)."""
    T, k = ids.shape
    flat = ids.reshape(-1)
    xs = x[:, None, :].expand(T, k, x.shape[-1]).reshape(T * k, 1, -1)  # (token, slot) order
    gate, up = torch.bmm(xs, gate_up[flat].transpose(1, 2)).chunk(2, dim=-1)
    y = torch.bmm(swiglu(gate, up, limit), down[flat].transpose(1, 2))[:, 0]  # [T*k, H]
    return _combine(x, y, weights)


def experts_fused(x, ids, weights, gate_up: torch.Tensor, down: torch.Tensor, limit=None) -> torch.Tensor:
    """The sorted rows through one Triton GEMM per projection (miles/engine/triton_moe.py)."""
    from miles.engine import triton_fused, triton_moe

    act = triton_fused.silu_mul if limit is None else lambda gu: swiglu(*gu.chunk(2, dim=-1), limit)
    y = triton_moe.experts_fused(x, ids, gate_up, down, act)
    return _combine(x, y, weights)


@functools.cache
def _capability(device: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def grouped_available(x: torch.Tensor, gate_up: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` takes these shapes on this device (CUDA, bf16, 16-byte rows)."""
    if not (x.is_cuda and hasattr(torch, "_grouped_mm") and x.dtype == torch.bfloat16):
        return False
    if _capability(x.device.index if x.device.index is not None else torch.cuda.current_device()) < (9, 0):
        return False
    E, two_i, H = gate_up.shape
    return H % 8 == 0 and (two_i // 2) % 8 == 0


def experts(x, ids, weights, gate_up: torch.Tensor, down: torch.Tensor, limit=None) -> torch.Tensor:
    """The sparse MLP's expert sum by the best exact path for the device (module docstring); `limit`:
    DeepSeek-V4's swiglu_limit."""
    if x.is_cuda and CUDA_PATH == "fused":
        return experts_fused(x, ids, weights, gate_up, down, limit)
    if x.is_cuda and CUDA_PATH == "grouped" and grouped_available(x, gate_up):
        return experts_grouped(x, ids, weights, gate_up, down, limit)
    if x.is_cuda and ids.numel() <= GATHER_MAX_ROWS:
        return experts_gathered(x, ids, weights, gate_up, down, limit)
    return experts_looped(x, ids, weights, gate_up, down, limit)


def sparse_mlp(
    x: torch.Tensor,
    gate: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    spec: MoeSpec,
    bias: torch.Tensor | None = None,
    table: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(routed experts' output [T, H], expert ids [T, k]) of a sparse layer for the normalised input
    x: router W_gate [E, H] (and DeepSeek's correction bias, or DeepSeek-V4's hash-table rows `table`
    [T, k] of the tokens), experts gate_up [E, 2I, H] and down [E, H, I]. A shared expert is the
    caller's (a dense MLP)."""
    if spec.scoring == "sqrtsoftplus":
        weights, ids = route_v4(x, gate, bias, spec, table)
    elif spec.scoring == "sigmoid":
        weights, ids = route_grouped(x, gate, bias, spec)
    else:
        weights, ids = route(x, gate, spec.top_k, spec.norm_topk_prob)
    return experts(x, ids, weights, gate_up, down, spec.swiglu_limit), ids


def per_expert(weights: dict[str, torch.Tensor], spec: MoeSpec) -> dict[str, torch.Tensor]:
    """`weights` with stacked expert tensors (transformers' in-memory `mlp.experts.gate_up_proj`
    [E, 2I, H] and `mlp.experts.down_proj` [E, H, I]) replaced by their per-expert HF-named views."""
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        head, _, tail = name.rpartition(".experts.")
        if tail not in ("gate_up_proj", "down_proj") or not head.startswith("model.layers."):
            out[name] = t
            continue
        if t.dim() != 3 or t.shape[0] != spec.num_experts:
            raise ValueError(f"{name}: expected [num_experts={spec.num_experts}, ...], got {tuple(t.shape)}")
        for e in range(spec.num_experts):
            if tail == "down_proj":
                out[f"{head}.experts.{e}.down_proj.weight"] = t[e]
            else:
                gate, up = t[e].chunk(2, dim=0)
                out[f"{head}.experts.{e}.gate_proj.weight"] = gate
                out[f"{head}.experts.{e}.up_proj.weight"] = up
    return out
