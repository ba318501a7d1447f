"""DeepSeek-V3's latent attention on Megatron over tensor-parallel ranks on the CPU, run under torchrun
by test_megatron_mla_ranks.py:

    torchrun --standalone --nproc-per-node N tests/integration/megatron_mla_ranks.py MODEL OUT TP

Real megatron-core layers (MLASelfAttention's column- and row-parallel projections) over gloo. Each
rank builds the GPTModel of miles/train/megatron/model.py with its slice of the HF weights, runs one
forward and backward of a fixed loss (the logits against fixed random weights), and writes
OUT/rank<R>.json: the loss, and each of its parameters' gradient, unsharded to the full Megatron
tensor where it is split (gathered over the tensor-parallel group), as float lists keyed by the
global Megatron name. The test compares every layout with the one-rank run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    model, out, tp = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    torch.cuda.current_device = lambda: torch.device("cpu")
    dist.init_process_group("gloo")
    from megatron.core import parallel_state as ps
    from transformers import AutoConfig

    from miles.train.megatron import convert
    from miles.train.megatron import model as M

    ps.initialize_model_parallel(tp, 1)
    hf_cfg = AutoConfig.from_pretrained(model)
    s = M.shapes_of(hf_cfg)
    gpt = M.build_gpt(hf_cfg, M.transformer_config(hf_cfg, torch.float32, tp, 1, use_cpu=True))
    M.load_hf_into(gpt, M.read_hf_state(model), hf_cfg)
    ids = torch.randint(4, 300, (2, 13), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(13).expand(2, 13)
    weights = torch.randn(2, 13, hf_cfg.vocab_size, generator=torch.Generator().manual_seed(1))
    logits = gpt(ids, pos, None)
    loss = (logits * weights).sum() / logits.numel()
    loss.backward()
    group = ps.get_tensor_model_parallel_group()
    full = convert.hf_to_megatron(M.read_hf_state(model), s)
    grads = {}
    for name, p in gpt.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        if p.shape != full[name].shape:  # a tensor-parallel slice: the full gradient from every rank's
            parts = [torch.empty_like(g) for _ in range(tp)]
            dist.all_gather(parts, g.contiguous(), group=group)
            g = convert.tp_unshard(name, parts, s)
        grads[name] = g.flatten().tolist()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps({"loss": loss.item(), "grads": grads}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
