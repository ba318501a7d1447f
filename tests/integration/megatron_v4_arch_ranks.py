"""DeepSeek-V4 as the Megatron backend builds it (miles/train/megatron/architectures.py), over ranks on the
CPU, run under torchrun by test_megatron_v4_architecture.py:

    torchrun --standalone --nproc-per-node N tests/integration/megatron_v4_arch_ranks.py MODEL OUT PP EP

Real megatron-core parallel state over gloo. The registered architecture builds this rank's stage
(PP=2: layers 3 / 2) and loads its slice of the checkpoint (EP=2: half the routed experts), then
runs a forward of a fixed loss (stage 0's streams cross to stage 1 folded, as Megatron's pipeline
sends them), and the backend's weight export gathers every tensor back under transformers' names, and each stage writes the plain
weights file a checkpoint keeps for `miles export` (OUT/run/checkpoints/step_1/megatron/). Rank 0
writes OUT/rank0.json: the loss (from the last stage), and the exported tensors' names and bytes'
digests.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron_v4_ranks import start


def main() -> None:
    model, out, pp, ep = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    cfg = start(model, pp, ep)  # the script beside this one
    from megatron.core import parallel_state as ps

    from miles.train.megatron import architectures
    from miles.train.megatron.model import read_hf_state

    arch = architectures.of(cfg)
    # the CPU's token dispatcher (all-gather) takes fixed shapes only: the schedule then sends
    # [seq_length, b, hidden], which the folded streams are with seq_length = s * hc_mult
    cpu = {
        "moe_token_dispatcher_type": "allgather",
        "variable_seq_lengths": False,
        "use_cpu_initialization": True,
    }
    tf = arch.config(
        cfg, torch.float32, 1, pp, ep=ep, stage_layers=(3, 2) if pp > 1 else (None, None), extra=cpu
    )
    gpt = arch.build(cfg, tf)
    arch.load(gpt, read_hf_state(model), cfg)

    ids = torch.randint(4, 300, (2, 11), generator=torch.Generator().manual_seed(0))
    weights = torch.randn(2, 11, cfg.vocab_size, generator=torch.Generator().manual_seed(1))
    total = weights.numel()
    if ep > 1:  # data parallel over the expert-parallel ranks: each rank its own row of the batch
        r = ps.get_expert_model_parallel_rank()
        ids, weights = ids[r : r + 1], weights[r : r + 1]
    # megatron-core's schedules allocate on "cuda" by name, so the stages talk here as they would:
    # stage 0's output (the streams folded to [s * N, b, D]) to stage 1, the forward only
    group, stage = ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_rank()
    if stage > 0:
        received = torch.empty(11 * cfg.hc_mult, ids.shape[0], cfg.hidden_size)
        dist.recv(received, group=group, group_src=stage - 1)
        gpt.set_input_tensor([received])  # as the schedule hands it: a one-element list
    with torch.no_grad():
        outputs = gpt(ids)
    loss = torch.zeros(())
    if gpt.post_process:
        loss = (outputs * weights).sum() / total
    else:
        dist.send(outputs.contiguous(), group=group, group_dst=stage + 1)
    dist.all_reduce(loss)  # the last stage's, summed over its data-parallel (expert-parallel) ranks
    exported = [pair for bucket in arch.export(gpt, cfg, 1 << 16, None) for pair in bucket]
    from miles.train.megatron import checkpoint

    checkpoint._megatron_dir(str(out / "run"), 1).mkdir(parents=True, exist_ok=True)
    checkpoint.save_model_file(gpt, str(out / "run"), 1)  # what a checkpoint keeps for `miles export`
    if dist.get_rank() == 0:
        digest = {n: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
                  for n, t in exported}  # fmt: skip
        out.mkdir(parents=True, exist_ok=True)
        (out / "rank0.json").write_text(json.dumps({"loss": loss.item(), "exported": digest}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
