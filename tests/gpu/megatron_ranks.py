"""One parallel layout of the Megatron backend, run under torchrun by test_megatron_gpu.py.

    torchrun --standalone --nproc-per-node 2 tests/gpu/megatron_ranks.py MODEL RUNS TP PP [lora]

Checks on rank 0: the exported weights equal the HF checkpoint, and one training step gives the HF
reference's loss, grad norm and update (fp32). With `lora` (run by test_megatron_lora_gpu.py) the run
trains an adapter, the export holds the adapter alone, and the reference is PEFT's model holding the
same adapter. Exits non-zero when a check fails.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import test_megatron_gpu as T  # noqa: E402

LORA = {
    "rank": 8,
    "alpha": 16,
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}
"""`lora` as the fifth argument: the run trains this adapter, and the reference is PEFT's (HF + adapter)."""


def main() -> None:
    model, runs, tp, pp = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    lora = LORA if sys.argv[5:] == ["lora"] else None
    extra = {"lora": lora} if lora else {}
    torch.backends.cuda.matmul.allow_tf32 = False
    from transformers import AutoModelForCausalLM

    from miles.train.megatron.backend import MegatronBackend

    b = MegatronBackend()
    b.setup(T._plan(model, runs, "float32", tensor_parallel=tp, pipeline_parallel=pp, **extra))
    rank = dist.get_rank()
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).cuda()
    box = [T._samples(hf) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    before = T._export(b)
    metrics = b.train(box[0])
    after = T._export(b)
    if rank != 0:
        assert not before and not after, "only rank 0 receives tensors"
        return
    if lora is None:  # the exported weights are the HF checkpoint's
        ref_state = {k: v.cpu() for k, v in hf.state_dict().items()}
        assert before.keys() == ref_state.keys() and all(
            torch.equal(before[k], ref_state[k]) for k in ref_state
        )
    else:  # the adapter alone: A and B of every projection of every layer, gathered over the stages
        assert len(before) == 2 * len(LORA["target_modules"]) * hf.config.num_hidden_layers
    loss, gn, ref_after = T._reference_step((model, runs, hf), box[0], 1e-3, lora=lora, adapter=before)
    d_ours = torch.cat([(after[k] - before[k]).flatten() for k in before])
    d_ref = torch.cat([(ref_after[k] - before[k]).flatten() for k in before])
    res = dict(
        lora=lora is not None,
        tp=tp,
        pp=pp,
        dp=dist.get_world_size() // (tp * pp),
        loss=metrics["loss"],
        ref_loss=loss,
        grad_norm=metrics["grad_norm"],
        ref_grad_norm=gn,
        update_rel_diff=((d_ours - d_ref).norm() / d_ref.norm()).item(),
    )
    print("RESULT", json.dumps(res))
    assert (
        abs(res["loss"] - loss) < 1e-4
        and abs(gn - res["grad_norm"]) < 1e-3 * gn
        and res["update_rel_diff"] < 1e-2
    )


if __name__ == "__main__":
    main()
