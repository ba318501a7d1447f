"""The one DDP and optimiser builder of the Megatron backend (the policy and PPO's critic alike)."""

from __future__ import annotations

from typing import Any

import torch


def wrap_for_training(
    tf: Any, gpt: torch.nn.Module, dtype: torch.dtype, train: Any, lr: float, opt_fields: dict[str, Any]
) -> tuple[Any, Any]:
    """`gpt` (bf16: inside Float16Module) under megatron-core's DistributedDataParallel with the
    distributed Adam of `train` (betas, weight decay, grad clip) at learning rate `lr`; `opt_fields`
    adds OptimizerConfig fields (optimizer offload). Returns (ddp, optimizer); `schedule_hooks` then
    gives `tf` what the pipeline schedule calls."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    wrapped = Float16Module(tf, gpt) if dtype == torch.bfloat16 else gpt
    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    ddp = DistributedDataParallel(tf, ddp_cfg, wrapped)
    opt_cfg = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        weight_decay=train.weight_decay,
        adam_beta1=train.betas[0],
        adam_beta2=train.betas[1],
        clip_grad=train.grad_clip,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        use_distributed_optimizer=True,
        **opt_fields,
    )
    return ddp, get_megatron_optimizer(opt_cfg, [ddp])


def schedule_hooks(tf: Any, ddp: Any, optimizer: Any) -> None:
    """The hooks the pipeline schedule calls (grad finalisation, loss scale, no-sync), set on `tf` last:
    a module built from `tf` afterwards (an MoE layer deep-copies its config) must not copy them."""
    from megatron.core.distributed import finalize_model_grads

    tf.finalize_model_grads_func = finalize_model_grads
    tf.grad_scale_func = optimizer.scale_loss
    tf.no_sync_func = ddp.no_sync
