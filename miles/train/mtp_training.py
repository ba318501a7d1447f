"""The model's MTP layer trained with the policy (`train.draft` with engine.speculative.algorithm NEXTN):
the draft the engine's NEXTN speculation proposes with (miles/engine/mtp.py) follows the policy.

The layer (miles/models/mtp.py: enorm, hnorm, eh_proj, one decoder layer of the model's family,
shared_head.norm) reads, at position t of a training sequence, the policy's final-normed hidden state
h_t from the policy's own training forward and the embedding of token t+1, and predicts token t+2
through the policy's LM head:

    loss = - sum over t of m_{t+1} m_{t+2} log softmax(W_head norm(layer(eh_proj([enorm(e_{t+1}); hnorm(h_t)]))))[x_{t+2}]
           / (the step's count of such t, over all ranks)

with m the trained-token mask (tokens the policy produced): both the input token and the target are
the policy's. h, the embedding and the LM head are detached, so the policy's parameters and gradients
are those of a run without it (tests/unit/test_draft_training.py); the layer has an AdamW of its own.

The hidden states come from the policy's own update passes, so no forward is added: the FSDP
backend's forward hook on the final norm, the Megatron backend's output processor (which receives the
final-normed hidden states of the whole micro-batch), each calling `hidden_sink` (`absorb`). Every rank
trains the layer on its own micro-batches (gradients accumulated as they come), then the gradients are
summed over the ranks (a tensor-parallel group's ranks see the same micro-batches and add their equal
shares to the sum and to the token count alike, leaving the mean as it is), clipped and stepped once per
training step. The embedding and LM head come whole to every rank (`lm_weights`: FSDP2 shards gathered,
Megatron's vocabulary shards gathered over the tensor-parallel group). Rank 0 exports the layer under
its checkpoint names (`model.layers.L.*`), which the engine loads into its MTP draft.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from miles.models.mtp import OWN, mtp_prefix, one_layer_config


def _transformers_class(module: nn.Module) -> type:
    """The transformers class of `module` (FSDP2 wraps modules in a subclass of their own)."""
    return next(c for c in type(module).__mro__ if c.__module__.startswith("transformers."))


def full_tensor(t: Tensor) -> Tensor:
    """`t` whole on every rank: an FSDP2 DTensor shard gathered (every rank takes part), else itself."""
    full = getattr(t, "full_tensor", None)
    return (full() if full is not None else t).detach()


def _layer_classes(config) -> tuple[type, type, type]:
    """(RMSNorm, decoder layer, rotary embedding): transformers' classes of `config`'s family, read off
    a one-layer skeleton built on the meta device (no memory, whichever backend trains the policy)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(one_layer_config(config)).model
    return (_transformers_class(base.norm), _transformers_class(base.layers[0]),
            _transformers_class(base.rotary_emb))  # fmt: skip


class MtpLayer(nn.Module):
    """The MTP layer as a module of transformers' classes of the policy's family (HF config `config`)."""

    def __init__(self, config: Any, tensors: dict[str, Tensor]) -> None:
        super().__init__()
        norm_cls, layer_cls, rotary_cls = _layer_classes(config)
        H, eps = config.hidden_size, config.rms_norm_eps
        self.enorm, self.hnorm, self.final = norm_cls(H, eps=eps), norm_cls(H, eps=eps), norm_cls(H, eps=eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.layer = layer_cls(one_layer_config(config), layer_idx=0)
        self.rotary = rotary_cls(config=config)
        self.prefix = mtp_prefix(config.num_hidden_layers)
        self.load_named(tensors)

    def _names(self) -> dict[str, Tensor]:
        own = dict(
            zip(
                OWN,
                (self.enorm.weight, self.hnorm.weight, self.eh_proj.weight, self.final.weight),
                strict=True,
            )
        )
        own.update({n: p for n, p in self.layer.named_parameters()})
        return {self.prefix + n: p for n, p in own.items()}

    def load_named(self, tensors: dict[str, Tensor]) -> None:
        params = self._names()
        missing = sorted(set(params) - set(tensors))
        if missing:
            raise ValueError(f"the checkpoint's MTP layer lacks {missing[:4]}")
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(tensors[n])

    def named_tensors(self) -> list[tuple[str, Tensor]]:
        return [(n, p.detach()) for n, p in self._names().items()]

    def forward(self, hidden: Tensor, next_ids: Tensor, positions: Tensor, embed: Tensor) -> Tensor:
        """Final-normed MTP hidden states [T, H] of one sequence: hidden [T, H] (h_t), next_ids [T]
        (x_{t+1}), positions [T]."""
        u = self.eh_proj(torch.cat((self.enorm(F.embedding(next_ids, embed)), self.hnorm(hidden)), -1))[None]
        cos_sin = self.rotary(u, positions[None])
        out = self.layer(u, attention_mask=None, position_ids=positions[None], position_embeddings=cos_sin)
        out = out[0] if isinstance(out, tuple) else out
        return self.final(out)[0]


class MtpTrainer:
    """The MTP layer, its optimiser and its step on every trainer rank (module docstring)."""

    def __init__(
        self, plan: Any, config: Any, device: torch.device, lm_weights: Callable[[], tuple[Tensor, Tensor]]
    ) -> None:
        """`config`: the policy's HF config; `lm_weights()`: its embedding and LM head, whole, on every
        rank (a collective: every rank calls it at `begin`)."""
        from miles.engine.spec import load_weights

        cfg = plan.train.draft
        tensors = load_weights(plan.model.path, prefix=mtp_prefix(config.num_hidden_layers))
        self.device, self.lm_weights = device, lm_weights
        self.layer = MtpLayer(config, tensors).to(device=device, dtype=torch.float32)
        self.optimizer = torch.optim.AdamW(self.layer.parameters(), lr=cfg.lr, weight_decay=0.0)
        self.grad_clip = cfg.grad_clip
        self._head: tuple[Tensor, Tensor] | None = None
        self._sums = torch.zeros(2, dtype=torch.float64)  # (nll sum, tokens) of the step on this rank

    def begin(self) -> None:
        """Before the policy's step: its embedding and LM head, whole, on every rank (a collective)."""
        embed, head = self.lm_weights()
        self._head = (
            embed.detach().to(self.device, torch.float32),
            head.detach().to(self.device, torch.float32),
        )
        self.optimizer.zero_grad(set_to_none=True)
        self._sums.zero_()

    def absorb(self, packed: Any, hidden: Tensor) -> None:
        """One update micro-batch's MTP loss (summed; scaled at `train`), backward at once."""
        if self._head is None:
            return
        embed, head = self._head
        ids, pos = packed.input_ids[0].to(self.device), packed.position_ids[0].to(self.device)
        trained = torch.zeros_like(ids, dtype=torch.bool)
        trained[packed.logit_index.to(self.device) + 1] = packed.mask.to(self.device) > 0
        hidden = hidden.reshape(-1, hidden.shape[-1]).detach().float()
        starts = (pos == 0).nonzero()[:, 0].tolist() + [len(ids)]
        total, count = hidden.new_zeros(()), 0
        for a, b in zip(starts[:-1], starts[1:], strict=True):
            n = b - a - 2  # positions t with t + 2 in the sequence
            if n <= 0:
                continue
            valid = trained[a + 1 : a + 1 + n] & trained[a + 2 : b]
            if not valid.any():
                continue
            out = self.layer(hidden[a : a + n], ids[a + 1 : a + 1 + n], pos[a : a + n], embed)
            nll = F.cross_entropy(F.linear(out, head), ids[a + 2 : b], reduction="none")
            total = total + (nll * valid).sum()
            count += int(valid.sum())
        if count:
            total.backward()
            self._sums += torch.tensor([float(total.detach()), float(count)], dtype=torch.float64)

    def train(self, samples: Any = None) -> dict[str, float]:
        """After the policy's step: gradients summed over ranks, over the step's MTP tokens, one step."""
        sums = self._sums.clone()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.layer.parameters()]
        if dist.is_initialized() and dist.get_world_size() > 1:
            flat = torch.cat([g.reshape(-1) for g in grads] + [sums.to(grads[0])])
            dist.all_reduce(flat)
            sums = flat[-2:].double().cpu()
            at = 0
            for g in grads:
                g.copy_(flat[at : at + g.numel()].view_as(g))
                at += g.numel()
        tokens = float(sums[1])
        for p, g in zip(self.layer.parameters(), grads, strict=True):
            p.grad = g / max(tokens, 1.0)
        norm = torch.nn.utils.clip_grad_norm_(self.layer.parameters(), self.grad_clip)
        if tokens:
            self.optimizer.step()
        self._head = None
        return {
            "draft/loss": float(sums[0]) / max(tokens, 1.0),
            "draft/tokens": tokens,
            "draft/grad_norm": float(norm),
        }

    def named_tensors(self) -> list[tuple[str, Tensor]]:
        return self.layer.named_tensors()

    def state(self) -> dict[str, Any]:
        return {"model": self.layer.state_dict(), "optimizer": self.optimizer.state_dict()}

    def restore(self, state: dict[str, Any]) -> None:
        self.layer.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
