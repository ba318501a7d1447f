"""Rollout routing replay (R3) and router metrics for mixture-of-experts models in the trainer.

An MoE layer's router turns a token's hidden state h into probabilities p = softmax(W h) over E
experts and sends the token to its top-k experts, weighted by p at those experts (divided by their
sum when the model's `norm_topk_prob` says so). The engine that sampled a rollout made that choice
with its own numerics; the trainer, recomputing it, can pick other experts for some tokens, and its
log-probs then drift from the rollout's for reasons that are not the policy's change. With
`train.routing_replay = rollout` the trainer's forward takes the engine's choice instead:

    idx_t = rollout experts of token t            (k ids per MoE layer, from Sample.routed_experts)
    w_t   = p_t[idx_t] / sum(p_t[idx_t])          (norm_topk_prob; else p_t[idx_t])

The weights stay a function of the router's logits, so the router still gets gradients; only the
(non-differentiable) selection is replaced.

DeepSeek routers score with a sigmoid (V3; the best expert groups first) or sqrtsoftplus (V4), choose
on the scores plus a correction bias, and weight by the scores normalised and times
`routed_scaling_factor`; replay keeps those weights and takes the rollout's experts.

Hugging Face MoE models (Qwen3-MoE, DeepSeek-V3/V4 in transformers 5) route in a `*TopKRouter` module returning
(logits, weights, indices). `RoutingReplay.install(model)` replaces each router's forward once;
per micro-batch, `RoutingReplay.batch(...)` installs the routing of the packed row
(miles/train/batching.py: one row of concatenated sequences) built by `packed_routing`. Positions
without an engine row (each sequence's last token, whose output predicts nothing trained) keep the
trainer's own choice.

Metrics, summed over the step's trained micro-batches: router agreement (share of token-layer
pairs whose top-k set used by the trainer equals the rollout's: exactly 1.0 under replay), the
trainer router's own agreement with the rollout, per-expert load and its imbalance (max/mean), and
the Switch load-balancing loss E * sum_e f_e P_e, measured (not added to the objective).

Megatron-core replays routing per MoE layer over its packed rows; `per_layer_rows` cuts the packed
routing into those [T, k] rows. Deliberately left out: shared experts (always on, nothing to
replay; DeepSeek-V4's hash-routed layers, whose experts the token id fixes), and partial rows
(`routed_experts_start_len`): a sample's rows must cover all its tokens but the last.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from miles.models.families.deepseek_v3 import group_limited
from miles.quant import invariant as inv
from miles.sample import Sample

_LAYER = re.compile(r"layers\.(\d+)\.")
STAT_KEYS = ("agree", "natural_agree", "pairs", "aux", "aux_layers")
"""Scalar sums kept per step; the per-(layer, expert) load follows them in `stats()`."""


@dataclass
class MoEShape:
    """What routing replay needs of the model: its routers and the routing layout."""

    layers: list[int]
    """Decoder layer index of each router, in forward order."""
    num_hidden_layers: int
    num_experts: int
    top_k: int


def find_routers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(decoder layer index, router) of every top-k router of a Hugging Face MoE model."""
    found = []
    for name, module in model.named_modules():
        if type(module).__name__.lower().endswith("topkrouter") and hasattr(module, "top_k"):
            match = _LAYER.search(name + ".")
            if match is None:
                raise ValueError(f"router {name} is not inside a numbered decoder layer")
            found.append((int(match.group(1)), module))
    return found


def packed_routing(
    samples: Sequence[Sample], indices: Sequence[int], shape: MoEShape, required: bool
) -> tuple[Tensor, Tensor] | None:
    """The routing of a packed row (batching.pack's order): ([T, n_routers, k] long, [T] bool valid).

    Sample rows are [len(tokens) - 1, width] with width = num_hidden_layers * k (SGLang's layout) or
    n_routers * k. None when no sample has rows and `required` is False; with `required` (replay on)
    a sample without rows is an error naming the key.
    """
    if not required and all(samples[i].routed_experts is None for i in indices):
        return None
    total = sum(len(samples[i].tokens) for i in indices)
    n_moe, k = len(shape.layers), shape.top_k
    routing = torch.zeros(total, n_moe, k, dtype=torch.long)
    valid = torch.zeros(total, dtype=torch.bool)
    offset = 0
    for i in indices:
        s = samples[i]
        n = len(s.tokens)
        if s.routed_experts is not None:
            routing[offset : offset + n - 1] = _sample_rows(s, shape)
            valid[offset : offset + n - 1] = True
        elif required:
            raise ValueError(
                f"train.routing_replay=rollout but sample (group_id={s.group_id}, index={s.index}) has no "
                "routed_experts: serve the model with an engine that returns them, or set "
                "train.routing_replay=off"
            )
        offset += n
    return routing, valid


def _sample_rows(s: Sample, shape: MoEShape) -> Tensor:
    rows = np.asarray(s.routed_experts)
    n, k = len(s.tokens), shape.top_k
    where = f"sample (group_id={s.group_id}, index={s.index})"
    if rows.ndim != 2 or rows.shape[0] != n - 1:
        raise ValueError(
            f"{where}: routed_experts has shape {rows.shape}, expected ({n - 1}, layers * top_k) "
            "(one row per token but the last)"
        )
    if rows.shape[1] == shape.num_hidden_layers * k:
        picked = rows.reshape(n - 1, shape.num_hidden_layers, k)[:, shape.layers]
    elif rows.shape[1] == len(shape.layers) * k:
        picked = rows.reshape(n - 1, len(shape.layers), k)
    else:
        raise ValueError(
            f"{where}: routed_experts rows have {rows.shape[1]} ids, expected num_hidden_layers x top_k = "
            f"{shape.num_hidden_layers} x {k} (is the engine serving the same model?)"
        )
    if picked.size and int(picked.max()) >= shape.num_experts:
        raise ValueError(f"{where}: routed_experts names expert {int(picked.max())} of {shape.num_experts}")
    return torch.from_numpy(picked.astype(np.int64))


def per_layer_rows(routing: Tensor, valid: Tensor, pad_to: int = 1) -> list[Tensor]:
    """Megatron-core's layout: one [T', k] int32 tensor per MoE layer over the packed rows, T' the
    row count padded up to a multiple of `pad_to` (padding and rows without an engine choice: -1)."""
    total = routing.shape[0]
    padded = -(-total // pad_to) * pad_to
    out = torch.full((padded, routing.shape[1], routing.shape[2]), -1, dtype=torch.int32)
    out[:total][valid] = routing[valid].to(torch.int32)
    return [out[:, layer].contiguous() for layer in range(routing.shape[1])]


class RoutingReplay:
    """Owns the patched routers of one model, the current micro-batch's routing and the step's sums."""

    shape: MoEShape
    replay: bool
    _routing: Tensor | None
    _valid: Tensor | None
    _use: bool
    _measure: bool
    _sums: Tensor
    _load: Tensor

    def __init__(self, shape: MoEShape, replay: bool) -> None:
        self.shape, self.replay = shape, replay
        self._routing = self._valid = None
        self._use = self._measure = False
        self.reset()

    @classmethod
    def install(cls, model: nn.Module, replay: bool) -> RoutingReplay | None:
        """Patch every router of `model` (None for a dense model)."""
        routers = find_routers(model)
        if not routers:
            return None
        cfg = getattr(model, "config", None)
        first = routers[0][1]
        shape = MoEShape(
            layers=[layer for layer, _ in routers],
            num_hidden_layers=int(getattr(cfg, "num_hidden_layers", max(r[0] for r in routers) + 1)),
            num_experts=int(first.num_experts),
            top_k=int(first.top_k),
        )
        rr = cls(shape, replay)
        for slot, (_, router) in enumerate(routers):
            router.forward = _bound_forward(router, rr, slot)
        return rr

    def reset(self) -> None:
        """Zero the step's sums."""
        self._sums = torch.zeros(len(STAT_KEYS), dtype=torch.float64)
        self._load = torch.zeros(len(self.shape.layers), self.shape.num_experts, dtype=torch.float64)

    @contextlib.contextmanager
    def batch(self, routing: tuple[Tensor, Tensor] | None, measure: bool) -> Iterator[None]:
        """Within: routers replay `routing` (when replay is on) and, with `measure`, add to the sums."""
        self._routing, self._valid = routing if routing is not None else (None, None)
        self._use, self._measure = self.replay and routing is not None, measure
        try:
            yield
        finally:
            self._routing = self._valid = None
            self._use = self._measure = False

    def route(self, slot: int, probs: Tensor, natural: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(experts used [T, k], the trainer's own choice [T, k]) for router `slot` given its scores
        [T, E] (`natural`: the router's own choice where it is not the top-k of `probs`)."""
        if natural is None:
            natural = torch.topk(probs, self.shape.top_k, dim=-1).indices
        used = natural
        given = (
            self._given(slot, probs) if self._routing is not None and (self._use or self._measure) else None
        )
        if self._use and given is not None:
            used = torch.where(given[1][:, None], given[0], natural)
        if self._measure:
            self.record(slot, probs.detach(), natural, used, given)
        return used, natural

    def _given(self, slot: int, probs: Tensor) -> tuple[Tensor, Tensor]:
        assert self._routing is not None and self._valid is not None
        if self._routing.shape[0] != probs.shape[0]:
            raise ValueError(
                f"routing for {self._routing.shape[0]} positions given to a forward of {probs.shape[0]}"
            )
        return self._routing[:, slot].to(probs.device), self._valid.to(probs.device)

    def record(
        self, slot: int, probs: Tensor, natural: Tensor, used: Tensor, given: tuple[Tensor, Tensor] | None
    ) -> None:
        """Add one router's pass to the sums, on the router's device (no host synchronisation): probs
        [T, E], the router's own top-k and the experts used [T, k], the rollout's experts [T, k] and
        which tokens have them [T] (None: no rollout routing)."""
        dev, f64 = used.device, torch.float64
        if self._sums.device != dev:
            self._sums, self._load = self._sums.to(dev), self._load.to(dev)
        counts = torch.zeros(self.shape.num_experts, dtype=f64, device=dev)
        counts.scatter_add_(0, used.reshape(-1), torch.ones(used.numel(), dtype=f64, device=dev))
        self._load[slot] += counts
        fraction = counts / max(probs.shape[0], 1)
        aux = self.shape.num_experts * (fraction * probs.double().mean(0)).sum()
        zero = aux.new_zeros(())
        agree, natural_agree, pairs = zero, zero, zero
        if given is not None:
            ref = given[0].to(dev).sort(-1).values
            valid = given[1].to(dev)
            agree = ((used.sort(-1).values == ref).all(-1) & valid).sum().to(f64)
            natural_agree = ((natural.sort(-1).values == ref).all(-1) & valid).sum().to(f64)
            pairs = valid.sum().to(f64)
        self._sums += torch.stack([agree, natural_agree, pairs, aux, zero + 1])

    def stats(self) -> Tensor:
        """The step's sums as one flat float64 tensor (all-reduce it over ranks, then `metrics`)."""
        return torch.cat([self._sums, self._load.reshape(-1)]).cpu()

    def metrics(self, stats: Tensor) -> dict[str, float]:
        """Router metrics from (all-reduced) `stats()`."""
        sums = dict(zip(STAT_KEYS, stats[: len(STAT_KEYS)].tolist(), strict=True))
        load = stats[len(STAT_KEYS) :].reshape(len(self.shape.layers), self.shape.num_experts)
        out: dict[str, float] = {}
        if sums["pairs"] > 0:
            out["router_agreement"] = sums["agree"] / sums["pairs"]
            out["router_natural_agreement"] = sums["natural_agree"] / sums["pairs"]
        if sums["aux_layers"] > 0:
            out["moe_aux_loss"] = sums["aux"] / sums["aux_layers"]
        per_layer = load.sum(1, keepdim=True)
        if float(per_layer.sum()) > 0:
            imbalance = load.max(1).values / (per_layer.squeeze(1) / self.shape.num_experts).clamp_min(1e-12)
            out["moe_load_imbalance"] = float(imbalance.mean())
            out["moe_load_imbalance_max"] = float(imbalance.max())
            share = load.sum(0) / load.sum()
            if self.shape.num_experts <= 64:
                out.update({f"moe_expert_load/{e}": float(v) for e, v in enumerate(share.tolist())})
        return out


def _bound_forward(router: nn.Module, rr: RoutingReplay, slot: int):
    """The router's forward with the selection taken from `rr` (same outputs as transformers')."""
    if hasattr(router, "routed_scaling_factor"):
        return _bound_deepseek(router, rr, slot)

    invariant = getattr(router, "invariant", False)  # train.true_on_policy (miles/quant/invariant.py)

    def forward(hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        hidden = hidden_states.reshape(-1, router.hidden_dim)
        if invariant:
            logits = inv.linear(hidden, router.weight)
            probs = inv.softmax(logits)
        else:
            logits = F.linear(hidden, router.weight)
            probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        used, _ = rr.route(slot, probs)
        weights = probs.gather(1, used)
        if router.norm_topk_prob:
            weights = inv.normalize(weights) if invariant else weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype), used

    return forward


def _deepseek_scores(router: nn.Module, hidden: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(logits, scores, own choice [T, k]) of a DeepSeek router: V3's sigmoid in fp32 with the
    correction bias and the best expert groups (DeepseekV3TopkRouter), V4's `score_fn` (sqrtsoftplus)
    with the correction bias (DeepseekV4TopKRouter)."""
    bias = router.e_score_correction_bias
    if not hasattr(router, "num_group"):
        logits = F.linear(hidden, router.weight)
        scores = router.score_fn(logits)
        return logits, scores, torch.topk(scores + bias, router.top_k, dim=-1, sorted=False).indices
    logits = F.linear(hidden.float(), router.weight.float())
    scores = logits.sigmoid()
    choice = group_limited(scores + bias, router.num_group, router.topk_group)
    # unsorted, as transformers' routers: the same order of experts, so the same sums bit for bit
    return logits, scores, torch.topk(choice, router.top_k, dim=-1, sorted=False).indices


def _bound_deepseek(router: nn.Module, rr: RoutingReplay, slot: int):
    """A DeepSeek router's forward with the selection from `rr`: the weights are the router's scores
    at the experts used, normalised (norm_topk_prob) and scaled by routed_scaling_factor."""

    def forward(hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        logits, scores, natural = _deepseek_scores(router, hidden_states.reshape(-1, router.hidden_dim))
        used, _ = rr.route(slot, scores, natural)
        weights = scores.gather(1, used)
        if getattr(router, "norm_topk_prob", True):
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, weights * router.routed_scaling_factor, used

    return forward
