"""PPO's critic in the Megatron backend: a second GPTModel of the policy's layout with a scalar value head.

The critic is built like the policy (same TransformerConfig fields, tensor / data / expert parallel
layout, bf16 in Float16Module, its own DDP and distributed Adam at train.critic.lr with the policy's
schedule shape) and loaded from train.critic.path or model.path. Its LM head is frozen and never
computed: GPTModel's `output_processor` hook picks the final hidden states of the positions that score
the response tokens (as the policy's `response_head` does) and applies `value_head`, a Linear(hidden, 1)
that starts at zero, replicated on the tensor-parallel ranks (they see the same hidden states).
Pipeline parallelism is refused (the values would live on the last stage only). The maths is
miles/train/losses/value.py; checkpoints hold it under megatron/critic/ (checkpoint.py).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from miles.config import ConfigError
from miles.sample import Sample
from miles.train.losses import token_weights
from miles.train.losses.aggregate import normalizers
from miles.train.losses.value import value_loss
from miles.train.megatron import batch as B
from miles.train.megatron import model as M
from miles.train.optim import lr_factor


def value_head(hidden_states: Tensor, mb: B.MicroBatch, head: torch.nn.Module, **_: Any) -> Tensor:
    """GPTModel's `output_processor` hook for the critic: values [T] (fp32), one per flat response token."""
    picked = hidden_states[mb.cols, mb.rows]  # [T, h]
    return head(picked).squeeze(-1).float()


class Critic:
    """The critic's model, DDP wrapper and optimizer on this rank, with its forward passes."""

    def __init__(
        self,
        plan: Any,
        hf_cfg: Any,
        tf_fields: dict[str, Any],
        opt_fields: dict[str, Any],
        forward_kwargs: dict[str, Any],
    ) -> None:
        from megatron.core import parallel_state as ps

        from miles.train.megatron.optim import schedule_hooks, wrap_for_training

        t = plan.train
        if t.pipeline_parallel > 1:
            raise ConfigError(
                "train.loss.advantage=ppo with train.backend=megatron builds its critic without pipeline "
                f"stages: set train.pipeline_parallel=1 (got {t.pipeline_parallel}) or use train.backend=fsdp"
            )
        if t.optimizer_offload == "nvme":
            raise ConfigError(
                "the Megatron critic keeps its optimizer on the GPU or the CPU: set train.optimizer_offload "
                "to none or cpu with train.loss.advantage=ppo"
            )
        self.plan, self.cfg = plan, t.critic
        self.lr = t.lr if t.critic.lr is None else t.critic.lr
        self.steps = 0
        """Training steps the critic has taken (its LR schedule and the warm-up count them)."""
        self._forward_kwargs = forward_kwargs
        dtype = torch.bfloat16 if plan.model.dtype == "bfloat16" else torch.float32
        tf = M.transformer_config(hf_cfg, dtype, **tf_fields)
        gpt = M.build_gpt(hf_cfg, tf, True, True)
        gpt.cuda(torch.cuda.current_device())
        M.load_hf_into(gpt, M.read_hf_state(t.critic.path or plan.model.path), hf_cfg)
        if gpt.output_layer.weight is not None:  # untied LM head: never computed, never trained
            gpt.output_layer.weight.requires_grad_(False)
        head = torch.nn.Linear(hf_cfg.hidden_size, 1, device=torch.cuda.current_device())
        torch.nn.init.zeros_(head.weight)
        torch.nn.init.zeros_(head.bias)
        gpt.value_head = head
        self.model, self.optimizer = wrap_for_training(tf, gpt, dtype, t, self.lr, opt_fields)
        schedule_hooks(tf, self.model, self.optimizer)
        self.dp_group = ps.get_data_parallel_group()

    @property
    def gpt(self):
        m = self.model.module
        return m.module if hasattr(m, "module") else m

    def _run(self, mbs: list[B.MicroBatch], loss_func: Any, forward_only: bool) -> list[dict]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def step(it, model):
            mb = next(it)
            out = model(
                mb.tokens,
                mb.positions,
                None,
                packed_seq_params=M.packed_seq_params(mb),
                **self._forward_kwargs,
                output_processor=partial(value_head, mb=mb, head=self.gpt.value_head),
            )
            return out, partial(loss_func, mb)

        return get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=iter(mbs),
            model=[self.model],
            num_microbatches=len(mbs),
            seq_length=max(m.tokens.shape[1] for m in mbs),
            micro_batch_size=max(m.tokens.shape[0] for m in mbs),
            forward_only=forward_only,
        )

    @torch.no_grad()
    def values(self, samples: list[Sample], mbs: list[B.MicroBatch]) -> list[Tensor]:
        """Values of each of `samples`' response tokens (packed as `mbs`), in `samples`' order, on the host."""
        found: list[Tensor | None] = [None] * len(samples)

        def collect(mb: B.MicroBatch, values: Tensor):
            sizes = [samples[i].response_length for i in mb.sample_ids]
            for i, part in zip(mb.sample_ids, values.split(sizes), strict=True):
                found[i] = part.float().cpu()
            return values.sum() * 0, {}

        self._run(mbs, collect, forward_only=True)
        return [
            v if v is not None else torch.zeros(s.response_length)
            for v, s in zip(found, samples, strict=True)
        ]

    def update(
        self,
        mini: list[Sample],
        mbs: list[B.MicroBatch],
        old: list[Tensor],
        returns: list[Tensor],
        stats: Tensor,
    ) -> float:
        """One optimiser update of the clipped value loss over this rank's micro-batches `mbs` of the
        mini-batch `mini` (`old` / `returns` per sample of this rank, indexed like the micro-batches'
        sample ids); adds (loss, clipped tokens) to stats[0:2]; returns the gradient norm."""
        from megatron.core import parallel_state as ps

        t = self.plan.train
        for g in self.optimizer.param_groups:
            g["lr"] = self.lr * lr_factor(self.steps, t)
        masks = [s.loss_mask for s in mini]  # check_samples: a mask covers each response
        norm = normalizers(masks, [float(s.weight) for s in mini])
        scale = len(mbs) * ps.get_data_parallel_world_size()

        def loss(mb: B.MicroBatch, values: Tensor):
            old_v = torch.cat([old[i] for i in mb.sample_ids]).to(values.device)
            ret = torch.cat([returns[i] for i in mb.sample_ids]).to(values.device)
            per_token, clipped = value_loss(values, old_v, ret, self.cfg.value_clip)
            w = token_weights(
                mb.mask, mb.seq_index, len(mb.sample_ids), t.loss.aggregation, *norm, mb.seq_weight
            )
            total = (w * per_token).sum()
            stats[0] += float(total.detach())
            stats[1] += float((mb.mask * clipped).sum())
            return total * scale, {}

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._run(mbs, loss, forward_only=False)
        _, grad_norm, _ = self.optimizer.step()
        return float(grad_norm or 0.0)

    def all_reduce(self, x: Tensor) -> Tensor:
        """Sum over the data-parallel ranks (the tensor-parallel ranks hold the same values)."""
        y = x.to(torch.cuda.current_device())
        dist.all_reduce(y, group=self.dp_group)
        return y.cpu()
