"""`miles export`: a checkpoint becomes a Hugging Face directory whose logits equal the trainer's.

FSDP: two steps of `miles train` on the CPU, `miles export`, then the exported model (transformers)
against the FSDP backend holding the same checkpoint. Megatron: a checkpoint in the backend's file
layout (TP=2 x PP=2 slices of a known model, written with the backend's own converter) exports to the
model it came from; so does a Qwen3-MoE checkpoint written with expert parallelism (EP=2, the dense
weights in the ep0 files only). Bad inputs are errors that say what to change."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import finish, miles_train

from miles.config import ConfigError
from miles.export import export_run
from miles.train.checkpoint import mark_complete, step_dir

PROBE = [7, 42, 99, 13, 250, 31, 8, 77, 120, 5]
TOL = 1e-5


def hf_logits(path: str | Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([PROBE])).logits[0]


def trainer_logits(run_dir: Path, step: int) -> torch.Tensor:
    """Logits of the FSDP backend after loading the checkpoint of `step` (one gloo rank, in process)."""
    from miles.cluster.distributed import teardown_distributed
    from miles.config.resolve import read_plan
    from miles.train import get_backend

    backend = get_backend("fsdp")()
    try:
        backend.setup(read_plan(run_dir / "plan.yaml"))
        backend.load(step)
        backend.model.eval()
        with torch.no_grad():
            return backend.model(torch.tensor([PROBE])).logits[0].float().cpu()
    finally:
        teardown_distributed()


@pytest.mark.slow
def test_fsdp_export_matches_the_trainer(recipe, tiny_model, tmp_path):
    path, run_dir = recipe(
        train={
            "steps": 2,
            "lr": 1e-2,
            "loss": {"entropy_coef": 0.01},  # moves the weights even when every reward of a group is equal
            "checkpoint": {"every_steps": 1, "keep_last": 2},
        }
    )
    finish(miles_train(path))
    out = tmp_path / "hf"
    cmd = [sys.executable, "-m", "miles.cli", "export", str(run_dir), "--step", "2", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert {"model.safetensors", "config.json", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    # every file as the umask makes new files (transformers writes its shards through mode-600 temp files)
    umask = os.umask(0)
    os.umask(umask)
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask

    exported, trained = hf_logits(out), trainer_logits(run_dir, 2)
    assert (exported - trained).abs().max() <= TOL
    assert (exported - hf_logits(tiny_model)).abs().max() > 1e-3  # the trained weights, not the base ones
    older = tmp_path / "hf1"
    export_run(run_dir, older, step=1)
    assert (hf_logits(older) - exported).abs().max() > 0  # --step picks the checkpoint


def megatron_run(root: Path, model_path: str, tp: int = 2, pp: int = 2, step: int = 3, ep: int = 1) -> Path:
    """A run directory holding a Megatron checkpoint of `model_path`'s weights (local layer spec);
    with ep > 1 the files are per expert-parallel rank as the backend's save writes them: ep0's the
    whole stage, the others only their experts, every rank's numbered from 0."""
    from transformers import AutoConfig

    from miles.train.megatron import convert
    from miles.train.megatron.model import read_hf_state

    cfg = AutoConfig.from_pretrained(model_path)
    shapes = convert.Shapes.from_hf(cfg)
    full = convert.hf_to_megatron(read_hf_state(model_path), shapes)
    per_stage = cfg.num_hidden_layers // pp
    run = root / "mg"
    mg_dir = step_dir(run, step) / "megatron"
    mg_dir.mkdir(parents=True)
    for stage in range(pp):
        first, last = stage * per_stage, (stage + 1) * per_stage
        for t in range(tp):
            state = {}
            for name, tensor in full.items():
                layer = convert.layer_of(name)
                on_stage = (
                    first <= layer < last
                    if layer is not None
                    else (name.startswith("embedding") and stage == 0)
                    or (not name.startswith("embedding") and stage == pp - 1)
                )
                if on_stage:
                    state[convert.to_local(name, first)] = convert.tp_shard(
                        name, tensor, t, tp, shapes
                    ).clone()
            for e in range(ep):
                shard = convert.ep_shard(state, e, ep, shapes)
                if e > 0:
                    shard = {k: v for k, v in shard.items() if convert.expert_of(k) is not None}
                shard["decoder.layers.0.self_attention.core_attention._extra_state"] = None
                tag = f"_ep{e}" if ep > 1 else ""
                torch.save(shard, mg_dir / f"model_tp{t}_pp{stage}{tag}.pt")
    torch.save({"step": step, "extra": {}}, step_dir(run, step) / "trainer.pt")
    mark_complete(run, step, keep_last=2)
    plan = {
        "run": {"name": "mg", "runs_root": str(root)},
        "model": {"path": model_path},
        "train": {"backend": "megatron"},
    }
    (run / "plan.yaml").write_text(yaml.safe_dump(plan))
    return run


@pytest.mark.parametrize("fmt", ["int4", "nvfp4", "fp8_row"])
def test_quantized_export_is_the_engine_format(tiny_model, tmp_path, fmt):
    """--quantized: the run's engine format, loaded as it is by the embedded engine, whose stored
    tensors are the contract's encoding of the checkpoint's weights."""
    from miles.engine.fp8_weights import build_decoder, checkpoint_layout
    from miles.engine.model import ModelSpec, load_weights
    from miles.quant.formats import engine_contract
    from miles.train.quant import export_pairs

    run = megatron_run(tmp_path, tiny_model, tp=1, pp=1)
    plan = yaml.safe_load((run / "plan.yaml").read_text())
    plan["engine"] = {"quantization": fmt, "int4_group_size": 32}
    (run / "plan.yaml").write_text(yaml.safe_dump(plan))
    out = export_run(run, tmp_path / "q", quantized=True)
    assert checkpoint_layout(out) == fmt
    from miles.config.resolve import read_plan

    contract = engine_contract(read_plan(run / "plan.yaml"))
    want = dict(export_pairs(load_weights(tiny_model).items(), contract))
    got = load_weights(out)
    assert sorted(got) == sorted(n for n in want if n != "lm_head.weight" or n in got)
    for name, t in want.items():
        if name in got:
            assert torch.equal(got[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name
    scheme = contract if not isinstance(contract, str) else None
    build_decoder(ModelSpec.from_dir(out), out, "cpu", torch.float32, fmt, 1024, scheme)
    with pytest.raises(ConfigError, match="export without --quantized"):
        plan["engine"] = {"quantization": "none"}
        (run / "plan.yaml").write_text(yaml.safe_dump(plan))
        export_run(run, tmp_path / "q2", quantized=True)


def test_megatron_export_rebuilds_the_model(tiny_model, tmp_path):
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(tiny_model).num_hidden_layers % 2 == 0
    run = megatron_run(tmp_path, tiny_model)
    out = export_run(run, tmp_path / "hf")  # no --step: the newest checkpoint that verifies
    assert (hf_logits(out) - hf_logits(tiny_model)).abs().max() <= TOL


def test_megatron_missing_slice_is_named(tiny_model, tmp_path):
    run = megatron_run(tmp_path, tiny_model)
    (step_dir(run, 3) / "megatron" / "model_tp1_pp1.pt").unlink()
    mark_complete(run, 3, keep_last=2)  # a consistent marker: the file is missing from the layout itself
    with pytest.raises(ConfigError, match="model_tp1_pp1.pt"):
        export_run(run, tmp_path / "hf")


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> Path:
    """A tiny random Qwen3-MoE: 4 layers (layer 0 dense), 4 routed experts."""
    from miles.models.tiny import init_tiny

    sizes = dict(hidden_size=64, num_hidden_layers=4, num_experts=4, num_experts_per_tok=2)
    return init_tiny(tmp_path_factory.mktemp("moe") / "m", arch="qwen3_moe", seed=5, **sizes)


@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_expert_parallel_export_rebuilds_the_model(tiny_moe, tmp_path, tp):
    run = megatron_run(tmp_path, str(tiny_moe), tp=tp, pp=2, ep=2)
    rank1 = torch.load(
        step_dir(run, 3) / "megatron" / "model_tp0_pp1_ep1.pt", map_location="cpu", weights_only=True
    )
    assert rank1 and all("local_experts" in k for k in rank1 if not k.endswith("_extra_state")), (
        "the synthetic ep1 file must hold only experts, as the backend's save writes it"
    )
    out = export_run(run, tmp_path / "hf")
    diff = (hf_logits(out) - hf_logits(tiny_moe)).abs().max()
    assert diff <= TOL, f"exported MoE logits differ from the source model's by {diff}"


def test_megatron_missing_ep_slice_is_named(tiny_moe, tmp_path):
    run = megatron_run(tmp_path, str(tiny_moe), tp=1, pp=2, ep=2)
    (step_dir(run, 3) / "megatron" / "model_tp0_pp1_ep1.pt").unlink()
    mark_complete(run, 3, keep_last=2)
    with pytest.raises(ConfigError, match=r"model_tp0_pp1_ep1\.pt .*EP=2"):
        export_run(run, tmp_path / "hf")


def test_bad_inputs_say_what_to_change(tiny_model, tmp_path):
    run = megatron_run(tmp_path, tiny_model)
    with pytest.raises(ConfigError, match="complete steps: 3"):
        export_run(run, tmp_path / "a", step=7)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(ConfigError, match="not empty"):
        export_run(run, tmp_path / "full")
    with pytest.raises(ConfigError, match="no plan.yaml"):
        export_run(tmp_path, tmp_path / "b")
