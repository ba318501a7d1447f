"""Mixture-of-experts (Qwen3-MoE) in the Megatron backend: config, layer specs and routing replay.

Maths, as transformers' `Qwen3MoeSparseMoeBlock`: logits z = W_router h, the k experts of largest z,
weights softmax(z)[idx] / sum(softmax(z)[idx]) when `norm_topk_prob` (else softmax(z)[idx]), output
sum_j w_j down_j(silu(gate_j h) * up_j h). Megatron-core computes the renormalised weights as the
softmax of the k chosen logits (`moe_router_pre_softmax=False`: softmax(z[idx]), the same numbers)
and the plain ones as softmax-then-gather (`moe_router_pre_softmax=True`). Layers that the HF config
keeps dense (`mlp_only_layers`, `decoder_sparse_step`) become `moe_layer_freq` zeros. The
load-balancing loss is measured, never added (`moe_aux_loss_coeff=0`): RL trains the policy's
objective only. Tokens move with the all-to-all dispatcher; experts are megatron's `SequentialMLP`
(its grouped-GEMM experts need Transformer Engine).

Routing replay (R3). Every router gets one of megatron-core's `RouterReplay` objects
(`moe_enable_routing_replay`). Per micro-batch forward, `MoERouting.micro_batch` hands each of this
stage's routers the rollout's experts for the forward's tokens in the router's own order (position-
major: token t of row b of an [s, b] batch is s_index * b_size + b) and sets `REPLAY_FORWARD`;
megatron then gathers the router's scores at those experts, so the weights stay differentiable in
the router. Tokens without an engine row (each sequence's last one, padding) are -1 there; this
module wraps each `RouterReplay.get_replay_topk` so that such tokens keep the router's own choice,
and so that every pass can be measured: agreement with the rollout, the router's own agreement,
per-expert load and the Switch load-balancing loss (miles/train/routing_replay.py's sums, shared
with the FSDP backend). The frozen KL reference replays the same experts. Under full activation
recompute the routers run again in the backward pass: a training forward's experts stay queued and
are replayed there with `REPLAY_BACKWARD`, in forward order.

Not built: tensor parallelism for MoE models (megatron's MoE needs sequence parallelism then, which
this backend does not use), shared experts (Qwen2-MoE), grouped / sigmoid routers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from miles.config import ConfigError
from miles.sample import Sample
from miles.train.megatron import convert
from miles.train.routing_replay import MoEShape, RoutingReplay, packed_routing, per_layer_rows


def check(hf_cfg: Any) -> None:
    """Refuse MoE configs this backend does not build, naming what to change (the layout's rules, e.g.
    no tensor parallelism for MoE, are miles/config/layout.py's)."""
    if not convert.num_experts(hf_cfg):
        return
    if hf_cfg.model_type not in ("qwen3_moe", "deepseek_v3"):
        raise ConfigError(
            f"model type {hf_cfg.model_type!r} has no Megatron MoE mapping (Qwen3-MoE and DeepSeek-V3): "
            "use train.backend=fsdp"
        )
    groups = int(getattr(hf_cfg, "n_group", 1) or 1)
    if (
        hf_cfg.model_type == "deepseek_v3"
        and groups > 1
        and hf_cfg.num_experts_per_tok != 2 * hf_cfg.topk_group
    ):
        raise ConfigError(
            f"num_experts_per_tok={hf_cfg.num_experts_per_tok} with topk_group={hf_cfg.topk_group}: megatron-core "
            "scores a group by its top num_experts_per_tok / topk_group experts, DeepSeek-V3 by its top 2; "
            "they agree only when num_experts_per_tok = 2 x topk_group: use train.backend=fsdp"
        )
    if hf_cfg.num_experts_per_tok == 1 and getattr(hf_cfg, "norm_topk_prob", False):
        raise ConfigError(
            "num_experts_per_tok=1 with norm_topk_prob has no Megatron router equivalent here (weight 1.0 "
            "per token); use train.backend=fsdp"
        )


def config_kwargs(hf_cfg: Any, expert_parallel: int) -> dict[str, Any]:
    """TransformerConfig fields of a Qwen3-MoE model ({} for a dense one)."""
    experts = convert.num_experts(hf_cfg)
    if not experts:
        return {}
    sparse = set(convert.sparse_layers(hf_cfg))
    return dict(
        num_moe_experts=experts,
        moe_router_topk=hf_cfg.num_experts_per_tok,
        moe_ffn_hidden_size=hf_cfg.moe_intermediate_size,
        moe_layer_freq=[int(i in sparse) for i in range(hf_cfg.num_hidden_layers)],
        **_router_kwargs(hf_cfg),
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_grouped_gemm=False,
        moe_enable_routing_replay=True,
        expert_model_parallel_size=expert_parallel,
    )


def _router_kwargs(hf_cfg: Any) -> dict[str, Any]:
    """The router: Qwen3-MoE's softmax top-k, or DeepSeek's sigmoid scores with a frozen correction
    bias, the best `topk_group` of `n_group` expert groups, normalised weights times
    `routed_scaling_factor`, and a shared expert beside the routed ones."""
    if getattr(hf_cfg, "n_routed_experts", None) is None:
        return dict(
            moe_router_score_function="softmax",
            moe_router_pre_softmax=not getattr(hf_cfg, "norm_topk_prob", False),
        )
    groups = int(getattr(hf_cfg, "n_group", 1) or 1)
    return dict(
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.0,  # transformers' bias is a buffer: it never moves in training
        moe_router_num_groups=groups if groups > 1 else None,
        moe_router_group_topk=int(hf_cfg.topk_group) if groups > 1 else None,
        moe_router_topk_scaling_factor=float(hf_cfg.routed_scaling_factor),
        moe_shared_expert_intermediate_size=hf_cfg.moe_intermediate_size * int(hf_cfg.n_shared_experts or 0)
        or None,
    )


def block_spec(tf_cfg: Any, use_te: bool, core_attention: Any):
    """Megatron's per-layer spec list for this pipeline stage (dense or MoE by `moe_layer_freq`); on the
    local spec every layer's core attention is `core_attention`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    spec = get_gpt_decoder_block_spec(tf_cfg, use_transformer_engine=use_te, normalization="RMSNorm")
    if not use_te:
        for layer in spec.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = core_attention
    return spec


_LAYER_NUMBER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
"""A layer's number in a module name: GPTModel's `decoder.layers.<i>.`, DeepseekV4GPT's `layers.<i>.`."""


def _routers(gpt: torch.nn.Module, layer_offset: int) -> list[tuple[int, Any]]:
    """(global decoder layer, TopKRouter) of this stage, in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    found = []
    for name, module in gpt.named_modules():
        if isinstance(module, TopKRouter):
            local = int(_LAYER_NUMBER.search(name).group(1))
            found.append((local + layer_offset, module))
    return sorted(found, key=lambda x: x[0])


class MoERouting:
    """The routers of this stage (the policy's, and the reference's when there is one): per micro-batch
    rollout routing through megatron-core's RouterReplay, and the step's router metrics."""

    stats: RoutingReplay
    """Step sums over every MoE layer of the model (slots: index in `Shapes.moe_layers`)."""
    stage: MoEShape
    """The MoE layers of this pipeline stage (what a micro-batch's routing is cut to)."""
    replay: bool
    measure: bool
    """Whether the policy's forwards add to the step's metrics now (set by the backend per phase)."""
    _moe_layers: tuple[int, ...]
    _replays: list[Any]
    """One RouterReplay per router of this stage, of every attached model, in layer order per model."""
    _pre_softmax: bool
    _recompute: bool
    """Full activation recompute: the routers run again in the backward pass (REPLAY_BACKWARD)."""
    _inside: bool
    """A micro-batch forward is running (recomputes in the backward pass are not measured)."""
    _real: Tensor | None
    """[s * b] bool, the current micro-batch's real (non-padding) tokens in router order; None when
    every position is real (nothing to filter, which spares a host synchronisation per router)."""
    _fillers: set[int]
    """ids of throw-away micro-batches (equal counts over expert-parallel ranks): never measured."""

    def __init__(self, gpt: torch.nn.Module, hf_cfg: Any, layer_offset: int, replay: bool) -> None:
        s = convert.Shapes.from_hf(hf_cfg)
        k = int(hf_cfg.num_experts_per_tok)
        self._moe_layers = s.moe_layers
        self.stats = RoutingReplay(MoEShape(list(s.moe_layers), s.num_layers, s.num_experts, k), replay)
        stage = [layer for layer, _ in _routers(gpt, layer_offset)]
        self.stage = MoEShape(stage, s.num_layers, s.num_experts, k)
        self.replay, self.measure = replay, False
        self._pre_softmax = not getattr(hf_cfg, "norm_topk_prob", False)
        self._recompute = getattr(gpt.config, "recompute_granularity", None) == "full"
        self._inside, self._real, self._fillers = False, None, set()
        self._replays = []
        self.attach(gpt, layer_offset, measured=True)

    def attach(self, gpt: torch.nn.Module, layer_offset: int, measured: bool) -> None:
        """Route `gpt`'s routers too (the frozen reference: same layers, `measured` False)."""
        from megatron.core.transformer.moe.router_replay import RouterReplay

        routers = _routers(gpt, layer_offset)
        assert [layer for layer, _ in routers] == self.stage.layers, "attached model has other MoE layers"
        for layer, router in routers:
            rr = router.router_replay
            assert isinstance(rr, RouterReplay), "moe_enable_routing_replay must be on (config_kwargs)"
            rr.get_replay_topk = self._topk(self._moe_layers.index(layer), rr, measured)
            self._replays.append(rr)

    def reset(self) -> None:
        """Zero the step's sums and forget any micro-batch routing left from an earlier step."""
        self.stats.reset()
        self.reset_routing()

    def reset_routing(self) -> None:
        """No replayed experts, no queued ones: the routers choose by themselves."""
        self._fillers.clear()
        for rr in self._replays:
            rr.clear_indices()
            rr.clear_router_replay_action()

    def pad_micro_batches(self, mbs: list[Any]) -> list[Any]:
        """With expert parallelism every rank must run as many forwards as the others (each MoE layer is
        an all-to-all): `mbs` plus copies of its last micro-batch with no trained token, up to the most
        any data-parallel rank has. Collective over the data-parallel group."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        if ps.get_expert_model_parallel_world_size() == 1:
            return mbs
        most = torch.tensor([len(mbs)], device=mbs[-1].mask.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group())
        extra = [
            dataclasses.replace(mbs[-1], mask=torch.zeros_like(mbs[-1].mask))
            for _ in range(int(most) - len(mbs))
        ]
        self._fillers.update(id(mb) for mb in extra)
        return mbs + extra

    @contextlib.contextmanager
    def micro_batch(self, samples: Sequence[Sample], mb: Any) -> Iterator[None]:
        """Within: the routers see the rollout's experts of micro-batch `mb` (its `sample_ids` index
        `samples`), replaying them when replay is on. Under full recompute a training forward's experts
        stay queued for the backward pass's recompute (REPLAY_BACKWARD pops them in forward order)."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        rows = None
        if self._replays:
            batch = tuple(mb.tokens.shape)
            rows = router_rows(samples, mb.sample_ids, batch, self.stage, self.replay)
            lengths = [len(samples[i].tokens) for i in mb.sample_ids]
            real = real_tokens(lengths, batch)
            self._real = None if real is None else real.to(mb.tokens.device, non_blocking=True)
        queued = self._recompute and torch.is_grad_enabled() and self.replay and rows is not None
        n = len(self.stage.layers)
        try:
            if rows is not None:
                for j, rr in enumerate(self._replays):
                    if not queued:
                        rr.clear_indices()
                    rr.set_target_indices(rows[j % n].to(mb.tokens.device, non_blocking=True))
                    if self.replay:
                        rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            self._inside = id(mb) not in self._fillers
            yield
        finally:
            self._inside, self._real = False, None
            for rr in self._replays:
                if queued:
                    rr.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
                else:
                    rr.clear_indices()
                    rr.clear_router_replay_action()

    def _topk(self, slot: int, rr: Any, measured: bool):
        """`RouterReplay.get_replay_topk` for router `slot`: replayed experts where the rollout has a row,
        the router's own top-k elsewhere; a measured router adds the pass to the step's sums."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction as A

        def get_replay_topk(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            values, natural = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            action = rr.router_replay_action
            given = rr.replay_backward_list.pop(0) if action == A.REPLAY_BACKWARD else rr.target_topk_idx
            given = None if given is None else given.to(scores.device).long()
            if given is not None and given.shape != natural.shape:
                raise ValueError(
                    f"routing replay: {tuple(given.shape)} expert ids given to a router pass over "
                    f"{tuple(natural.shape)} (tokens, top_k)"
                )
            used = natural
            if given is not None and action in (A.REPLAY_FORWARD, A.REPLAY_BACKWARD):
                used = torch.where(given >= 0, given, natural)
                values = scores.gather(1, used)
            if measured and self.measure and self._inside:
                self._record(slot, scores.detach(), natural.detach(), used.detach(), given)
            return values, used

        return get_replay_topk

    def _record(self, slot: int, scores: Tensor, natural: Tensor, used: Tensor, given: Tensor | None) -> None:
        """Add one router pass over the real tokens (padding left out) to the step's sums."""
        probs = scores.float() if self._pre_softmax else torch.softmax(scores.float(), dim=-1)
        ref = None if given is None else (given.clamp_min(0), (given >= 0).all(-1))
        real = self._real
        if real is not None and real.shape[0] == probs.shape[0]:
            probs, natural, used = probs[real], natural[real], used[real]
            ref = None if ref is None else (ref[0][real], ref[1][real])
        self.stats.record(slot, probs, natural, used, ref)

    def metrics(self) -> dict[str, float]:
        """The step's router metrics summed over all ranks (collective: every rank calls it, after the
        step's last backward); the step's queued routing is dropped."""
        import torch.distributed as dist

        self.reset_routing()
        stats = self.stats.stats().to(torch.cuda.current_device())
        dist.all_reduce(stats)
        return self.stats.metrics(stats.cpu())


def router_rows(
    samples: Sequence[Sample],
    sample_ids: Sequence[int],
    batch: tuple[int, int],
    shape: MoEShape,
    required: bool,
) -> list[Tensor] | None:
    """The rollout's experts of a [b, s] micro-batch holding `samples[sample_ids]`: one [s * b, k] int32
    tensor per MoE layer of `shape`, in the router's token order (position-major), -1 where there is
    no row. None when no sample has rows and `required` is False (routing_replay.packed_routing)."""
    packed = packed_routing(samples, sample_ids, shape, required=required)
    if packed is None:
        return None
    routing, valid = packed
    b, width = batch
    dims = routing.shape[1:]
    grid = torch.zeros(width, b, *dims, dtype=routing.dtype)
    grid_valid = torch.zeros(width, b, dtype=torch.bool)
    lengths = [len(samples[i].tokens) for i in sample_ids]
    offset = 0
    for row, start, n in _placement(lengths, b, width):
        grid[start : start + n, row] = routing[offset : offset + n]
        grid_valid[start : start + n, row] = valid[offset : offset + n]
        offset += n
    return per_layer_rows(grid.reshape(width * b, *dims), grid_valid.reshape(-1))


def real_tokens(lengths: list[int], batch: tuple[int, int]) -> Tensor | None:
    """[s * b] bool in the router's token order: True at the positions of the sequences' tokens. None
    when the sequences fill every position (a full packed row): filtering by a boolean mask costs a
    host synchronisation per MoE layer, so callers skip it."""
    b, width = batch
    placement = list(_placement(lengths, b, width))
    if sum(lengths) == b * width:
        return None
    real = torch.zeros(width, b, dtype=torch.bool)
    for row, start, n in placement:
        real[start : start + n, row] = True
    return real.reshape(-1)


def _placement(lengths: list[int], b: int, width: int) -> Iterator[tuple[int, int, int]]:
    """(batch row, first position, length) of each sequence: one sequence per row from position 0
    (right-padded rows), or all of them back to back in one row (packed)."""
    if b == len(lengths) and max(lengths) <= width:
        yield from ((row, 0, n) for row, n in enumerate(lengths))
    elif b == 1 and sum(lengths) <= width:
        starts = [sum(lengths[:j]) for j in range(len(lengths))]
        yield from ((0, start, n) for start, n in zip(starts, lengths, strict=True))
    else:
        raise ValueError(
            f"routing replay: cannot place sequences of lengths {lengths} in a [{b}, {width}] batch"
        )
