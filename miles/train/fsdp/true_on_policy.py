"""True on-policy training on FSDP (`train.true_on_policy`): the policy's forward through the
batch-invariant operations of miles/quant/invariant.py, the ones the embedded engine's forward calls
under `--enable-deterministic-inference`, so the trainer's log-probs of the rollout's tokens equal the
engine's bit for bit.

`install(model)` swaps the computations of a transformers causal LM (Qwen2, Qwen3, Llama, Qwen3-MoE)
module by module, leaving its module tree, parameters, FSDP units and checkpoints as they are:
every nn.Linear's forward, every RMSNorm's, the MLP's activation, the MoE routers and experts (routing
replay, installed after, keeps the router's invariant numerics), the rotary embedding's cos / sin,
and the attention function (registered with transformers' AttentionInterface as `miles_invariant`:
each packed sequence's queries over their own prefix, sequences found from position_ids restarting at
0). What transformers computes itself between them (embedding lookup, residual additions, the RoPE
products, q/k views) is exact elementwise work. `logprobs` is the log-softmax side.
"""

from __future__ import annotations

import types

import torch
from torch import Tensor, nn

from miles.quant import invariant as inv

FAMILIES = ("qwen2", "qwen3", "llama", "qwen3_moe")
"""Model types the invariant forward covers (default RoPE, SiLU MLPs; Qwen3-MoE's softmax routers)."""
ATTENTION = "miles_invariant"


def unsupported(config) -> str | None:
    """Why a model of this HF config cannot train true on-policy, or None."""
    kind = getattr(config, "model_type", "?")
    if kind not in FAMILIES:
        return f"model type {kind!r} (true on-policy covers the dense families {', '.join(FAMILIES)})"
    if getattr(config, "shared_expert_intermediate_size", 0):
        return "a shared expert"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} (SiLU MLPs only)"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type != "default":
        return f"rope_scaling {rope_type!r} (the default RoPE only)"
    if getattr(config, "use_sliding_window", False):
        return "a sliding attention window"
    return None


def _linear_forward(self: nn.Linear, x: Tensor) -> Tensor:
    return inv.linear(x, self.weight, self.bias)


class _Stacked:
    """Sibling nn.Linear modules that read one input (an attention's q / k / v, an MLP's gate / up),
    multiplied as one GEMM of their weights stacked by rows when the first is called, as the engine
    multiplies its fused qkv_proj / gate_up_proj: the others then return their share of it. A member
    called on another input computes alone."""

    def __init__(self, members: list[nn.Linear]) -> None:
        self.members = members
        self.sizes = [m.out_features for m in members]
        self.pending: tuple[Tensor, dict[int, Tensor]] | None = None
        """The first member's input and the shares of the others not yet taken."""

    def forward(self, index: int, x: Tensor) -> Tensor:
        if index == 0:
            weights = [m.weight for m in self.members]
            bias = inv.stacked_bias([m.bias for m in self.members], self.sizes, weights[0])
            first, *rest = inv.stacked_linear(x, weights, bias, self.sizes)
            self.pending = (x, dict(enumerate(rest, start=1)))
            return first
        pending = self.pending
        if pending is not None and pending[0] is x and index in pending[1]:
            out = pending[1].pop(index)
            if not pending[1]:
                self.pending = None
            return out
        member = self.members[index]
        return inv.linear(x, member.weight, member.bias)


SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Linear modules of one parent that read the same input, in the order transformers calls them."""


def _stack_siblings(model: nn.Module) -> None:
    for module in model.modules():
        for names in SIBLINGS:
            members = [getattr(module, n, None) for n in names]
            if all(isinstance(m, nn.Linear) for m in members):
                group = _Stacked(members)
                for i, m in enumerate(members):
                    m.forward = types.MethodType(lambda self, x, i=i, g=group: g.forward(i, x), m)


def _norm_forward(self: nn.Module, x: Tensor) -> Tensor:
    eps = getattr(self, "variance_epsilon", getattr(self, "eps", 1e-6))
    return inv.rms_norm(x, self.weight, eps)


def _silu_forward(self: nn.Module, x: Tensor) -> Tensor:
    return inv.silu(x)


def _router_forward(self: nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """A Qwen3-MoE router's (logits, top-k weights in the logits' dtype, expert ids)."""
    hidden = hidden_states.reshape(-1, self.hidden_dim)
    logits = inv.linear(hidden, self.weight)
    _, weights, ids = inv.route(logits, self.top_k, self.norm_topk_prob)
    return logits, weights.to(logits.dtype), ids


def _experts_forward(self: nn.Module, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    return inv.experts(hidden, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj)


def _rotary_forward(self: nn.Module, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
    if self._miles_inv_freq.device != x.device:  # moved once, not copied every forward
        self._miles_inv_freq = self._miles_inv_freq.to(x.device)
    return inv.rope_cos_sin(position_ids, self._miles_inv_freq, x.dtype)


def _sequences(positions: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each sequence of a row's positions (they restart at 0 for each sequence)."""
    starts = [0] + [i for i, p in enumerate(positions) if p == 0 and i > 0]
    return list(zip(starts, starts[1:] + [len(positions)], strict=True))


_rows_seen: tuple[Tensor, int, bool, list] | None = None
"""The last position_ids tensor (held, so no other tensor can be it), its version, the kernel path and
its rows' sequences: every layer of a forward (and its backward) gets the same tensor, read to the
host once."""


def _packed_rows(position_ids: Tensor, kernels: bool) -> list:
    """Per row of `position_ids` [B, S], its packed sequences: invariant_triton.PackedRow (on the
    device) with the Triton kernels, else (starts, lengths)."""
    global _rows_seen
    seen = _rows_seen
    if seen is None or seen[0] is not position_ids or seen[1] != position_ids._version or seen[2] != kernels:
        rows = []
        for positions in position_ids.tolist():
            bounds = _sequences(positions)
            starts, lengths = [a for a, _ in bounds], [b - a for a, b in bounds]
            rows.append(inv.gpu_kernels().PackedRow.of(starts, lengths, position_ids.device) if kernels
                        else (starts, lengths))  # fmt: skip
        _rows_seen = seen = (position_ids, position_ids._version, kernels, rows)
    return seen[3]


def attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    position_ids: Tensor | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers' attention-function contract: query [B, H, S, D], key / value [B, KVH, S, D]
    (RoPE applied) -> ([B, S, H, D], None). Causal within each sequence of the packed rows."""
    B, H, S, D = query.shape
    if position_ids is None:
        position_ids = torch.arange(S, device=query.device).expand(B, S)
    scale = scaling if scaling is not None else D**-0.5
    kernels = inv.kernels_for(query)
    rows = _packed_rows(position_ids, kernels)  # read to the host once a forward, not once a layer
    rows = rows * B if len(rows) == 1 else rows  # one row of positions for every row
    if kernels:  # each row's sequences through one kernel (miles/quant/invariant_triton.py)
        attend = inv.gpu_kernels().packed_attention
        out = [attend(query[r].transpose(0, 1), key[r], value[r], rows[r], scale) for r in range(B)]
        return torch.stack(out).contiguous(), None
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    outs = []
    for row, (starts, lengths) in enumerate(rows):
        parts = []
        for a, n in zip(starts, lengths, strict=True):
            sl = slice(a, a + n)
            pos = torch.arange(n, device=q.device)[None]
            parts.append(
                inv.attention(q[row : row + 1, sl], k[row : row + 1, sl], v[row : row + 1, sl], pos, scale)
            )
        outs.append(torch.cat(parts, dim=1))
    return torch.cat(outs).contiguous(), None


def install(model: nn.Module) -> None:
    """Route `model`'s forward through the invariant operations (module docstring). Raises ValueError
    naming what stops it (unsupported)."""
    from transformers import AttentionInterface

    config = model.config
    why = unsupported(config)
    if why is not None:
        raise ValueError(f"train.true_on_policy cannot hold for {why}")
    AttentionInterface.register(ATTENTION, attention_forward)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    theta = float(
        getattr(config, "rope_theta", None) or (config.rope_parameters or {}).get("rope_theta", 10000.0)
    )
    for module in model.modules():
        name = type(module).__name__
        if isinstance(module, nn.Linear):
            module.forward = types.MethodType(_linear_forward, module)
        elif name.endswith("RMSNorm"):
            module.forward = types.MethodType(_norm_forward, module)
        elif name in ("SiLUActivation", "SiLU"):
            module.forward = types.MethodType(_silu_forward, module)
        elif name.endswith("TopKRouter"):  # routing replay, when installed after, keeps this flag
            module.invariant = True
            module.forward = types.MethodType(_router_forward, module)
        elif name.endswith("Experts") and hasattr(module, "gate_up_proj"):
            module.forward = types.MethodType(_experts_forward, module)
        elif name.endswith("RotaryEmbedding"):
            module._miles_inv_freq = inv.inverse_frequencies(head_dim, theta, "cpu")
            module.forward = types.MethodType(_rotary_forward, module)
    _stack_siblings(model)  # after the loop above: their forwards replace the plain linear one
    model.set_attn_implementation(ATTENTION)


def logprobs(logits: Tensor, rows: Tensor, targets: Tensor, temperature: float) -> Tensor:
    """The response tokens' log-probs from the packed logits [N, V]: rows `rows`, ids `targets`."""
    return inv.token_logprobs(logits, targets, temperature, rows)
