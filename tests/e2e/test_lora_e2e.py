"""LoRA end to end on the CPU: `miles train` with train.lora (PEFT in the FSDP trainer, the adapter served
unmerged by the embedded engine, only the adapter pushed each step and checked by checksums), then
`miles export`: the PEFT adapter that peft.PeftModel loads, and `--merge`, both with the trainer's logits;
a checkpoint holds the adapter and the optimiser state of the adapter alone."""

from __future__ import annotations

import pytest
import torch
from conftest import finish, miles_train

from miles.export import export_run
from miles.metrics import read_metrics

pytestmark = pytest.mark.slow

PROBE = [7, 42, 99, 13, 250, 31, 8, 77, 120, 5]
TARGETS = ["q_proj", "v_proj", "down_proj"]


def _trainer(run_dir, step: int):
    """The FSDP backend holding the checkpoint of `step` (one gloo rank, in process)."""
    from miles.config.resolve import read_plan
    from miles.train import get_backend

    backend = get_backend("fsdp")()
    backend.setup(read_plan(run_dir / "plan.yaml"))
    backend.load(step)
    backend.model.eval()
    return backend


def test_lora_run_pushes_the_adapter_and_exports_it(recipe, tiny_model, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from miles.cluster.distributed import teardown_distributed

    path, run_dir = recipe(
        run={"name": "lora"},
        train={
            "steps": 3,
            "lr": 5e-2,
            "lora": {"rank": 4, "alpha": 8, "target_modules": TARGETS},
            "loss": {"entropy_coef": 0.01},  # moves the adapter even when every reward of a group is equal
            "checkpoint": {"every_steps": 3},
        },
        weights={"transport": "lora", "check": True},
    )
    finish(miles_train(path))
    records = [r for r in read_metrics(run_dir) if r["step"] > 0 and "weights/push_bytes" in r]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["weights/checksum_mismatch"] == 0.0 for r in records)

    backend = _trainer(run_dir, 3)
    try:
        with torch.no_grad():
            trained = backend.model(torch.tensor([PROBE])).logits[0].float()
        adam = backend.optimizer.state_dict()["state"]
        trainable = [p for p in backend.model.parameters() if p.requires_grad]
        assert len(adam) == len(trainable) == 2 * 2 * len(TARGETS)  # adapter parameters only
    finally:
        teardown_distributed()

    out = export_run(run_dir, tmp_path / "adapter")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in out.iterdir()}
    from safetensors.torch import load_file

    adapter = load_file(str(out / "adapter_model.safetensors"))
    assert len(adapter) == 2 * 2 * len(TARGETS)
    # each push carried the adapter alone (fp32), not the model
    assert all(r["weights/push_bytes"] == sum(t.numel() * 4 for t in adapter.values()) for r in records)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    plain = base(torch.tensor([PROBE])).logits[0].detach()
    peft_model = PeftModel.from_pretrained(base, str(out)).eval()
    with torch.no_grad():
        served = peft_model(torch.tensor([PROBE])).logits[0]
    assert (served - trained).abs().max() <= 1e-5
    assert (served - plain).abs().max() > 1e-3  # the adapter moved

    merged = export_run(run_dir, tmp_path / "merged", merge=True)
    full = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (full(torch.tensor([PROBE])).logits[0] - trained).abs().max() <= 1e-4


def test_two_adapters_train_on_their_own_tasks_in_one_run(recipe, tiny_model, tmp_path):
    """train.lora.adapters: two adapters, each on its own digits task with its own optimiser, served by
    the same engine under their own names and pushed (both, checked by checksums) after every step;
    evaluated one held-out set each; exported one PEFT directory each, with the trainer's logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from miles.cluster.distributed import teardown_distributed
    from miles.lora.adapters import activate

    tasks = {
        op: {"name": "digits", "options": {"op": op, "num_digits": 2}, "eval_size": 4}
        for op in ("last", "first")
    }
    path, run_dir = recipe(
        run={"name": "lora2"},
        rollout={"schedule": "async"},
        eval={"every_steps": 3, "samples_per_prompt": 2},
        train={
            "steps": 3,
            "lr": 5e-2,
            "lora": {
                "rank": 4,
                "alpha": 8,
                "target_modules": TARGETS,
                "adapters": [{"name": op, "task": task} for op, task in tasks.items()],
            },
            "loss": {"entropy_coef": 0.01},
            "checkpoint": {"every_steps": 3},
        },
        weights={"transport": "lora", "check": True},
    )
    finish(miles_train(path))
    records = {r["step"]: r for r in read_metrics(run_dir)}
    pushes = [r for s, r in records.items() if s > 0 and "weights/push_bytes" in r]
    assert len(pushes) == 3 and all(r["weights/checksum_mismatch"] == 0.0 for r in pushes)
    one = 2 * 2 * len(TARGETS)
    assert {r["weights/push_bytes"] for r in pushes} == {2 * sum(
        4 * (4 * p.shape[1] if "lora_A" in n else p.shape[0] * 4) for n, p in _targets(tiny_model)
    )}  # fmt: skip
    assert any("train/last/loss" in r for r in pushes) and any("train/first/loss" in r for r in pushes)
    for name in ("last", "first"):
        assert 0.0 <= records[3][f"eval/{name}/pass@1"] <= 1.0

    backend = _trainer(run_dir, 3)
    try:
        logits = {}
        for name in ("last", "first"):
            assert len(backend.adapters.optimizers[name].state) <= one
            activate(backend.model, name)
            with torch.no_grad():
                logits[name] = backend.model(torch.tensor([PROBE])).logits[0].float()
    finally:
        teardown_distributed()
    assert (logits["last"] - logits["first"]).abs().max() > 1e-4  # two adapters, trained apart

    out = export_run(run_dir, tmp_path / "adapters")
    assert sorted(p.name for p in out.iterdir()) == ["first", "last"]
    for name in ("last", "first"):
        base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
        peft_model = PeftModel.from_pretrained(base, str(out / name)).eval()
        with torch.no_grad():
            assert (peft_model(torch.tensor([PROBE])).logits[0] - logits[name]).abs().max() <= 1e-5
    merged = export_run(run_dir, tmp_path / "merged", merge=True, adapter="first")
    full = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (full(torch.tensor([PROBE])).logits[0] - logits["first"]).abs().max() <= 1e-4


def _targets(model_path):
    """(name, weight) of the tiny model's linear layers the adapters cover."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    for name, module in model.named_modules():
        if name.split(".")[-1] in TARGETS:
            for part in ("lora_A", "lora_B"):
                yield f"{name}.{part}", module.weight
