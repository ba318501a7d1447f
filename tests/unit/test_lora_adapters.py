"""Several LoRA adapters in one FSDP trainer (train.lora.adapters), in this process (one rank, real gloo
group): each adapter trains only on its own samples with its own AdamW, leaves the trainer under its own
name, and a checkpoint restores every adapter and every optimiser. Also the prompt stream that feeds
them (one task per adapter, each prompt naming its adapter) and the config rules."""

from __future__ import annotations

import pytest
import torch

from miles.cluster.distributed import teardown_distributed
from miles.config import ConfigError, resolve
from miles.eval.datasets import build_suites
from miles.rollout.engine_argv import engine_argv
from miles.rollout.tasks import plan_task
from miles.sample import Sample
from miles.train import get_backend

PROMPT = [11, 22, 33, 44]
GOOD, BAD = [50, 60, 70, 80], [90, 100, 110]
TARGETS = ["q_proj", "v_proj"]
ADAPTERS = [
    {"name": "last", "task": {"name": "digits", "options": {"op": "last", "num_digits": 2}, "eval_size": 4}},
    {
        "name": "first",
        "task": {"name": "digits", "options": {"op": "first", "num_digits": 2}, "eval_size": 3},
    },
]


@pytest.fixture(scope="module", autouse=True)
def _process_group():
    yield
    teardown_distributed()


def _recipe(**lora):
    return {
        "train": {"lora": {"rank": 4, "alpha": 8, "target_modules": TARGETS, "adapters": ADAPTERS, **lora}}
    }


def _backend(tiny_model: str, run_dir):
    recipe = _recipe()
    recipe["model"] = {"path": tiny_model}
    recipe["run"] = {"runs_root": str(run_dir.parent), "name": run_dir.name}
    recipe["train"].update(device="cpu", steps=8, lr=1e-2, loss={"entropy_coef": 0.01})
    backend = get_backend("fsdp")()
    backend.setup(resolve(recipe))
    return backend


def _group(group_id: int, adapter: str) -> list[Sample]:
    meta = {"lora_path": adapter}
    return [
        Sample(group_id, 0, PROMPT, GOOD, [1] * 4, [-5.0] * 4, reward=1.0, metadata=dict(meta)),
        Sample(group_id, 1, PROMPT, BAD, [1] * 3, [-5.0] * 3, reward=0.0, metadata=dict(meta)),
    ]


def _adapter(backend, name: str) -> dict[str, torch.Tensor]:
    """Adapter `name`'s tensors as the trainer exports them."""
    return {
        n: t.clone()
        for bucket in backend.export_weights(1 << 20)
        for n, t in bucket
        if n.startswith(name + "/")
    }


def test_each_adapter_trains_on_its_own_samples_with_its_own_optimizer(tiny_model, tmp_path):
    backend = _backend(tiny_model, tmp_path / "run")
    before = {n: _adapter(backend, n) for n in ("last", "first")}
    names = {n for bucket in backend.export_weights(1 << 20) for n, _ in bucket}
    # PEFT's saved names under each adapter's own name: what /load_lora_adapter_from_tensors takes
    assert names == {
        f"{a}/base_model.model.model.layers.{i}.self_attn.{m}.lora_{x}.weight"
        for a in ("last", "first") for i in range(2) for m in TARGETS for x in "AB"
    }  # fmt: skip

    metrics = backend.train(_group(0, "last"))
    assert "last/loss" in metrics and "first/loss" not in metrics
    after = {n: _adapter(backend, n) for n in ("last", "first")}
    assert any((after["last"][k] - before["last"][k]).abs().max() > 0 for k in before["last"])
    assert all(torch.equal(after["first"][k], before["first"][k]) for k in before["first"])
    opt = backend.adapters.optimizers
    assert len(opt["last"].state) == 2 * 2 * len(TARGETS) and len(opt["first"].state) == 0

    metrics = backend.train(_group(0, "last") + _group(1, "first"))
    assert {"last/loss", "first/loss", "loss"} <= set(metrics)
    assert metrics["loss"] == pytest.approx((metrics["last/loss"] + metrics["first/loss"]) / 2)
    assert len(opt["first"].state) == 2 * 2 * len(TARGETS)
    # the schedules keep the run's step whether or not their adapter had samples
    assert [s.last_epoch for s in backend.adapters.schedulers.values()] == [2, 2]

    with pytest.raises(ValueError, match="'other'"):
        backend.train(_group(2, "other"))


def test_checkpoint_restores_every_adapter_and_optimizer(tiny_model, tmp_path):
    backend = _backend(tiny_model, tmp_path / "run")
    backend.train(_group(0, "last") + _group(1, "first"))
    backend.save(1)
    saved = {n: _adapter(backend, n) for n in ("last", "first")}
    moments = {
        n: [s["exp_avg"].clone() for s in o.state.values()] for n, o in backend.adapters.optimizers.items()
    }
    backend.train(_group(0, "last") + _group(1, "first"))
    backend.load(1)
    assert backend.step == 1
    for name in ("last", "first"):
        assert all(torch.equal(_adapter(backend, name)[k], saved[name][k]) for k in saved[name])
        restored = [s["exp_avg"] for s in backend.adapters.optimizers[name].state.values()]
        assert all(torch.equal(a, b) for a, b in zip(restored, moments[name], strict=True))


def test_prompt_stream_alternates_adapters_and_evaluates_each():
    plan = resolve(_recipe())
    task = plan_task(plan)
    prompts = [task.train_prompt(i) for i in range(6)]
    assert [p.metadata["lora_path"] for p in prompts] == ["last", "first"] * 3
    assert [p.index for p in prompts] == list(range(6))
    assert prompts[0].text.startswith("last digit") and prompts[1].text.startswith("first digit")
    suites = build_suites(plan, task)
    assert [(s.name, len(s.prompts)) for s in suites] == [("last", 4), ("first", 3)]
    assert all(p.metadata["lora_path"] == s.name for s in suites for p in s.prompts)
    argv = engine_argv(plan)
    assert argv[argv.index("--max-loras-per-batch") + 1] == "2"  # a slot for every adapter


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"train": {"lora": {"adapters": [ADAPTERS[0], ADAPTERS[0]]}}}, "names must differ"),
        ({"rollout": {"generate_fn": "miles.agentic.rollout:generate"}}, "generate_fn"),
        ({"train": {"optimizer_offload": "cpu"}}, "optimizer_offload=none"),
        ({"eval": {"mode": "dedicated"}}, "eval.mode=shared"),
    ],
)
def test_several_adapters_refuse_what_they_are_not_built_for(extra, message):
    recipe = _recipe()
    for section, values in extra.items():
        if section == "train" and "lora" in values:
            recipe["train"]["lora"].update(values["lora"])
        else:
            recipe.setdefault(section, {}).update(values)
    with pytest.raises(ConfigError, match=message):
        resolve(recipe)
