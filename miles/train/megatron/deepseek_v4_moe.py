"""DeepSeek-V4's mixture of experts as Megatron modules: its two routers and its clamped SwiGLU.

Maths, as transformers' `DeepseekV4SparseMoeBlock`:
- scores s = sqrtsoftplus(z) = sqrt(softplus(z)) of the router logits z = W h (in fp32);
- a learned layer (`mlp_layer_types` "moe") picks the k experts of largest s + b (b: the frozen
  correction bias, `e_score_correction_bias`); a hash layer ("hash_moe") picks the experts of the
  token's row of the frozen table `tid2eid[token id]`, whatever the scores;
- the weights are s at the picked experts, normalised to sum 1 (+1e-20) and times
  `routed_scaling_factor`;
- every expert and the shared expert compute down(silu(min(gate, L)) * clamp(up, -L, L)) with L =
  `swiglu_limit`: megatron-core's `activation_func_clamp_value` is exactly that clamp.

`SqrtSoftplusRouter` and `hash_router(vocab)` are megatron-core `TopKRouter`s (same parameter names:
`router.weight`, `router.expert_bias`; the hash router adds `router.tid2eid`), so they drop into
megatron-core's MoE layer spec as its `router` submodule (`moe_spec`). The learned router honours
routing replay (megatron-core's RouterReplay hook, as miles/train/megatron/moe.py drives it); a hash
layer's choice is its table's and needs none. A hash router reads the forward's token ids from a
`TokenIds` holder that `watch_token_ids` keeps current on the GPTModel (a router sees only hidden
states), in the router's token order (position-major over Megatron's [s, b]).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.router import TopKRouter


def _weighted(scores: torch.Tensor, indices: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs [T, E] with the normalised, scaled weights at `indices` and 0 elsewhere, routing map)."""
    w = scores.gather(1, indices)
    w = w / (w.sum(dim=-1, keepdim=True) + 1e-20) * scale
    probs = torch.zeros_like(scores).scatter(1, indices, w)
    routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, indices, True)
    return probs, routing_map


def sqrtsoftplus(logits: torch.Tensor) -> torch.Tensor:
    return torch.sqrt(F.softplus(logits.float()))


class SqrtSoftplusRouter(TopKRouter):
    """DeepSeek-V4's learned router (module docstring); `expert_bias` is its frozen correction bias,
    a buffer of its own (fp32): the config leaves megatron-core's bias updating off, whose step-end
    update would also look for a bias on the hash routers, which have none."""

    def __init__(self, config: Any, pg_collection: Any = None, **kwargs: Any) -> None:
        super().__init__(config=config, pg_collection=pg_collection, **kwargs)
        self.__dict__.pop("expert_bias", None)  # the plain attribute megatron-core sets without its bias
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.register_buffer("expert_bias", torch.zeros(config.num_moe_experts, device=device))

    def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
        logits = logits.view(-1, self.config.num_moe_experts)
        scores = sqrtsoftplus(logits)
        biased = scores + self.expert_bias.float()

        def natural(s: torch.Tensor, k: int, num_groups=None, group_topk=None):
            return torch.topk(s, k=k, dim=1)

        if self.router_replay is not None:
            _, indices = self.router_replay.get_replay_topk(biased, self.topk, None, None, natural)
        else:
            _, indices = natural(biased, self.topk)
        probs, routing_map = _weighted(scores, indices, self.config.moe_router_topk_scaling_factor or 1.0)
        return probs.type_as(logits), routing_map


class TokenIds:
    """The token ids of the GPTModel forward running now, in the routers' token order."""

    def __init__(self) -> None:
        self.ids: torch.Tensor | None = None


class _HashRouter(TopKRouter):
    """DeepSeek-V4's hash router (module docstring): experts from `tid2eid[token id]`."""

    vocab_size = 0

    def __init__(self, config: Any, pg_collection: Any = None, **kwargs: Any) -> None:
        super().__init__(config=config, pg_collection=pg_collection, **kwargs)
        self.register_buffer("tid2eid", torch.zeros(self.vocab_size, self.topk, dtype=torch.long))
        self.tokens: TokenIds | None = None

    def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
        logits = logits.view(-1, self.config.num_moe_experts)
        if self.tokens is None or self.tokens.ids is None or self.tokens.ids.numel() != logits.shape[0]:
            raise RuntimeError("hash router: no token ids for this forward (watch_token_ids(gpt) wires them)")
        indices = self.tid2eid[self.tokens.ids.to(self.tid2eid.device)].long()
        probs, routing_map = _weighted(
            sqrtsoftplus(logits), indices, self.config.moe_router_topk_scaling_factor or 1.0
        )
        return probs.type_as(logits), routing_map


def hash_router(vocab_size: int) -> type[TopKRouter]:
    """The hash router class of a model with `vocab_size` tokens (its table's rows)."""
    return type("HashRouter", (_HashRouter,), {"vocab_size": int(vocab_size)})


def build_moe(router: type[TopKRouter], config: Any, layer_number: int, use_te: bool = False):
    """megatron-core's MoE layer with `router` as its router (`moe_spec`), built."""
    from megatron.core.transformer.spec_utils import build_module

    spec = moe_spec(router, use_te)
    if isinstance(spec, functools.partial):
        return spec(config=config, layer_number=layer_number)
    return build_module(spec, config=config, layer_number=layer_number)


def moe_spec(router: type[TopKRouter], use_te: bool = False):
    """megatron-core's MoE layer spec with `router` as its router: a ModuleSpec, or (megatron-core 0.19
    on) a partial of the MoE layer."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    spec = get_moe_module_spec(use_te=use_te, num_experts=1, moe_grouped_gemm=False)
    if isinstance(spec, functools.partial):  # megatron-core >= 0.19: partial(MoELayer, submodules=...)
        submodules = dataclasses.replace(spec.keywords["submodules"], router=router)
        return functools.partial(spec.func, *spec.args, **(spec.keywords | {"submodules": submodules}))
    spec.submodules.router = router  # a ModuleSpec
    return spec


def watch_token_ids(model: torch.nn.Module, tokens: TokenIds | None = None) -> TokenIds:
    """Keep a TokenIds holder current with `model`'s forwards (its first argument: [b, s] token ids)
    and hand it to every hash router in `model`; returns the holder."""
    tokens = tokens or TokenIds()
    for module in model.modules():
        if isinstance(module, _HashRouter):
            module.tokens = tokens

    def before(_module, args, kwargs):
        ids = args[0] if args else kwargs.get("input_ids")
        tokens.ids = None if ids is None else ids.t().reshape(-1)  # [b, s] -> position-major [s * b]

    model.register_forward_pre_hook(before, with_kwargs=True)
    return tokens
