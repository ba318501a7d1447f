"""DeepSeek-V4 of Miles' Megatron modules over pipeline- or expert-parallel ranks on the CPU, run under
torchrun by test_megatron_v4_ranks.py:

    torchrun --standalone --nproc-per-node N tests/integration/megatron_v4_ranks.py MODEL OUT PP EP

Real megatron-core parallel state over gloo. With PP=2 the tiny model's five layers split 3 / 2 (the
last stage one layer short): stage 0 sends its hyper-connection streams [s, b, N, D], folded to
[s * N, b, D] as Megatron's pipeline sends three dimensions, to stage 1 and receives their gradient back, as Megatron's schedule does. With EP=2 each rank holds half the routed
experts (megatron-core's MoE layer exchanges the tokens) and its own row of the batch, as data
parallelism gives it; the dense gradients are summed over the ranks as data-parallel training sums
them. Each rank runs one forward and backward of
a fixed loss (the logits against fixed random weights) and writes OUT/rank<R>.json: the loss (last
stage) and the gradient of every parameter it holds, keyed by global name (experts by global number).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist

STAGES = {1: [range(0, 5)], 2: [range(0, 3), range(3, 5)]}


def start(model: str, pp: int, ep: int):
    """gloo ranks on the CPU with megatron-core's parallel state of PP x EP; the model's HF config."""
    torch.cuda.current_device = lambda: torch.device("cpu")
    dist.init_process_group("gloo")
    from megatron.core import parallel_state as ps
    from transformers import AutoConfig

    from miles.train.megatron.model import _moe_utils_without_te

    _moe_utils_without_te()
    ps.initialize_model_parallel(1, pp, expert_model_parallel_size=ep)
    return AutoConfig.from_pretrained(model)


def main() -> None:
    model, out, pp, ep = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    cfg = start(model, pp, ep)
    from megatron.core import parallel_state as ps

    from miles.train.megatron import deepseek_v4_model as V4
    from miles.train.megatron.model import read_hf_state

    stage = ps.get_pipeline_model_parallel_rank()
    extra = {
        "moe_token_dispatcher_type": "allgather",
        "variable_seq_lengths": False,
        "pipeline_model_parallel_size": pp,
    }
    gpt = V4.DeepseekV4GPT(cfg, V4.transformer_config(cfg, torch.float32, use_cpu=True, ep=ep, extra=extra),
                           STAGES[pp][stage])  # fmt: skip
    local = cfg.n_routed_experts // ep
    first = ps.get_expert_model_parallel_rank() * local
    full = V4.to_megatron(read_hf_state(model))
    own = {k for k in gpt.state_dict() if not k.endswith("_extra_state")}
    state = {_local(k, first, local): v for k, v in full.items() if _local(k, first, local) in own}
    assert own == set(state), sorted(own - set(state))[:5]
    gpt.load_state_dict(state, strict=False)

    ids = torch.randint(4, 300, (2, 13), generator=torch.Generator().manual_seed(0))
    weights = torch.randn(2, 13, cfg.vocab_size, generator=torch.Generator().manual_seed(1))
    total = weights.numel()
    if ep > 1:  # data parallel over the expert-parallel ranks: each rank its own row of the batch
        rank = ps.get_expert_model_parallel_rank()
        ids, weights = ids[rank : rank + 1], weights[rank : rank + 1]
    shape = (13 * cfg.hc_mult, ids.shape[0], cfg.hidden_size)  # the streams as a stage sends them (fold)
    group = ps.get_pipeline_model_parallel_group()
    result = {}
    if stage > 0:
        received = torch.empty(shape)
        dist.recv(received, group=group, group_src=stage - 1)
        gpt.set_input_tensor(received.requires_grad_(True))
    outputs = gpt(ids)
    if gpt.post_process:
        loss = (outputs * weights).sum() / total
        loss.backward()
        if ep > 1:
            loss = loss.detach()
            dist.all_reduce(loss, group=ps.get_data_parallel_group())
        result["loss"] = loss.item()
    else:
        dist.send(outputs.detach(), group=group, group_dst=stage + 1)
        grad = torch.empty(shape)
        dist.recv(grad, group=group, group_src=stage + 1)
        outputs.backward(grad)
    if stage > 0:
        dist.send(received.grad, group=group, group_dst=stage - 1)
    if ep > 1:  # what data-parallel training sums: the dense gradients over the ranks (the experts
        # already saw every rank's tokens through the token exchange)
        for n, p in gpt.named_parameters():
            if ".local_experts." not in n and p.grad is not None:
                dist.all_reduce(p.grad, group=ps.get_data_parallel_group())
    result["grads"] = {
        _global(n, first): (p.grad if p.grad is not None else torch.zeros_like(p)).flatten().tolist()
        for n, p in gpt.named_parameters()
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


_EXPERT = re.compile(r"(local_experts\.)(\d+)(\.)")


def _local(name: str, first: int, local: int) -> str | None:
    """A full model's expert name as this expert-parallel rank numbers it (None: another rank's)."""
    m = _EXPERT.search(name)
    if m is None:
        return name
    e = int(m.group(2)) - first
    return _EXPERT.sub(lambda g: f"{g.group(1)}{e}{g.group(3)}", name) if 0 <= e < local else None


def _global(name: str, first: int) -> str:
    return _EXPERT.sub(lambda g: f"{g.group(1)}{int(g.group(2)) + first}{g.group(3)}", name)


if __name__ == "__main__":
    main()
