"""Megatron LoRA over two tensor- or pipeline-parallel ranks on the CPU, run under torchrun by
test_megatron_lora_ranks.py:

    torchrun --standalone --nproc-per-node N tests/integration/megatron_lora_ranks.py MODEL OUT TP PP

Real megatron-core layers over gloo: the GPTModel of miles/train/megatron/model.py, this rank's slice
of the HF weights, and the adapters of miles/train/megatron/lora.py. megatron-core's layers compute on
the CPU as they do on a GPU, but a few of its helpers ask CUDA for the current device; here that
question answers the CPU (nothing else is changed).

Each rank runs one forward and backward of the whole model (with two pipeline stages, stage 0 sends
its hidden states to stage 1 and receives their gradient back, as Megatron's schedule does) and
compares with PEFT's model holding the same adapter, which it builds itself: the logits on the last
stage, and the gradient of every adapter tensor it holds. It writes OUT/rank<R>.json; rank 0 also
writes the exported adapter (every stage's, gathered) to OUT/adapter.pt.
"""

from __future__ import annotations

import json
import sys
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SEED = 5


def main() -> None:
    model, out, tp, pp = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    torch.cuda.current_device = lambda: torch.device("cpu")
    dist.init_process_group("gloo")
    from megatron.core import parallel_state as ps
    from transformers import AutoConfig

    from miles.config.train import LoraConfig
    from miles.train.megatron import lora
    from miles.train.megatron import model as M

    ps.initialize_model_parallel(tp, pp)
    hf_cfg = AutoConfig.from_pretrained(model)
    s = M.shapes_of(hf_cfg)
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    gpt = M.build_gpt(hf_cfg, M.transformer_config(hf_cfg, torch.float32, tp, pp, use_cpu=True), first, last)
    M.load_hf_into(gpt, M.read_hf_state(model), hf_cfg)
    cfg = LoraConfig(rank=4, alpha=8, target_modules=TARGETS)
    offset = M.layer_offset(gpt)
    lora.install(gpt, cfg, hf_cfg, SEED)
    with torch.no_grad():  # B away from zero (seeded by the global name: the same in every layout)
        for name, p in gpt.named_parameters():
            if ".lora_B_" in name:
                g = torch.Generator().manual_seed(
                    zlib.crc32(lora.peft_name(*name.rsplit(".", 1), offset).encode())
                )
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    exported = {n.removeprefix("policy/"): t.clone() for n, t in lora.adapter_tensors(gpt, "policy", s)}

    ids = torch.randint(4, 300, (2, 11), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(11).expand(2, 11)
    weights = torch.randn(2, 11, hf_cfg.vocab_size, generator=torch.Generator().manual_seed(1))
    peft = _peft(model, cfg, exported)
    want = peft(ids).logits
    (want * weights).sum().backward()
    result = {"trainable": sorted(n for n, p in gpt.named_parameters() if p.requires_grad)}

    group = ps.get_pipeline_model_parallel_group()
    hidden_shape = (ids.shape[1], ids.shape[0], hf_cfg.hidden_size)  # Megatron's [s, b, h]
    if not first:
        received = torch.empty(hidden_shape)
        dist.recv(received, group=group, group_src=ps.get_pipeline_model_parallel_rank() - 1)
        received.requires_grad_(True)
        gpt.set_input_tensor(received)
    ours = gpt(ids, pos, None)
    if last:
        result["logits_err"] = ((ours - want).norm() / want.norm()).item()
        (ours * weights).sum().backward()
    else:
        dist.send(ours.detach(), group=group, group_dst=ps.get_pipeline_model_parallel_rank() + 1)
        grad = torch.empty(hidden_shape)
        dist.recv(grad, group=group, group_src=ps.get_pipeline_model_parallel_rank() + 1)
        ours.backward(grad)
    if not first:
        dist.send(received.grad, group=group, group_dst=ps.get_pipeline_model_parallel_rank() - 1)

    peft_grads = {n.replace(".default", ""): p.grad for n, p in peft.named_parameters() if p.grad is not None}
    errs = {}
    for name, p in gpt.named_parameters():
        if p.requires_grad:
            ref = peft_grads[lora.peft_name(*name.rsplit(".", 1), offset)]
            errs[name] = ((p.grad - ref).norm() / ref.norm()).item()
    result["grad_err"] = errs
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    if dist.get_rank() == 0:
        torch.save(exported, out / "adapter.pt")
    dist.destroy_process_group()


def _peft(model: str, cfg, exported: dict[str, torch.Tensor]):
    """The HF model with PEFT's adapter holding `exported` (PEFT's saved names), in training mode."""
    from peft import get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from miles.lora.adapters import peft_config

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    peft = get_peft_model(hf, peft_config(cfg))
    set_peft_model_state_dict(peft, exported)
    return peft


if __name__ == "__main__":
    main()
