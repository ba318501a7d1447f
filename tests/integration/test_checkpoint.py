"""Checkpoints of the FSDP backend: resume with another rank count continues exactly, keep-last,
completion markers, and the Hugging Face export."""

from __future__ import annotations

import pytest
import torch
from test_fsdp_ranks import probe_ids, reference_runs

from miles.train.checkpoint import COMPLETE, complete_steps, latest_complete_step, step_dir
from miles.train.fsdp.checkpoint import load_checkpoint

TOL = 1e-5


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    return reference_runs(tiny_model, str(tmp_path_factory.getbasetemp() / "fsdp_runs"))


@pytest.mark.slow
def test_resume_on_one_rank_from_two_rank_checkpoint(runs):
    one, two, resumed = runs["one"], runs["two"], runs["resumed"]
    assert resumed["world_size"] == 1 and two["world_size"] == 2
    assert resumed["step_after_load"] == 2
    assert resumed["extra"] == {"data_position": 20}
    for m_resumed, m_straight in zip(resumed["metrics"], one["metrics"][2:], strict=True):
        assert m_resumed["lr"] == pytest.approx(m_straight["lr"])  # the LR schedule resumed too
        assert m_resumed["loss"] == pytest.approx(m_straight["loss"], rel=TOL, abs=1e-6)
    for ref in (two, one):
        w_ref = ref["tensors"]["weights"]
        w = resumed["tensors"]["weights"]
        assert max((w[k] - w_ref[k]).abs().max().item() for k in w) <= TOL


@pytest.mark.slow
def test_keep_last_and_complete_markers(runs):
    run_dir = runs["root"] / "two"
    assert complete_steps(run_dir) == [2, 4]  # step 1 was pruned (keep_last=2)
    assert not step_dir(run_dir, 1).exists()
    assert latest_complete_step(run_dir) == 4
    for step in (2, 4):
        files = {p.name for p in step_dir(run_dir, step).iterdir()}
        assert {COMPLETE, "state", "trainer.pt", "rng_rank0.pt", "rng_rank1.pt"} <= files


@pytest.mark.slow
def test_export_hf_is_loadable_and_matches_trainer(runs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_dir = runs["root"] / "hf"
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([probe_ids()])).logits[0]
    assert (logits - runs["two"]["tensors"]["logits"]).abs().max() <= TOL
    tok = AutoTokenizer.from_pretrained(hf_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert "<|im_start|>user" in text and tok.eos_token == "<|im_end|>"


def test_incomplete_checkpoints_are_ignored(tmp_path):
    for step, complete in ((3, True), (5, False)):
        d = step_dir(tmp_path, step)
        d.mkdir(parents=True)
        if complete:
            (d / COMPLETE).write_text(f"{step}\n")
    (tmp_path / "checkpoints" / "notes").mkdir()
    assert complete_steps(tmp_path) == [3]
    assert latest_complete_step(tmp_path) == 3
    assert latest_complete_step(tmp_path / "nowhere") is None
    with pytest.raises(FileNotFoundError, match="incomplete; complete steps: 3"):
        load_checkpoint(tmp_path, 5, None, None, None)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        load_checkpoint(tmp_path / "nowhere", None, None, None, None)


@pytest.mark.slow
def test_resume_with_offloaded_optimizer_is_exact(tiny_model, tmp_path):
    from test_fsdp_ranks import make_samples

    from miles.cluster.distributed import teardown_distributed
    from miles.config import resolve
    from miles.train import get_backend

    def backend():
        train = {"device": "cpu", "lr": 1e-3, "optimizer_offload": "cpu"}
        plan = resolve({"model": {"path": tiny_model}, "run": {"runs_root": str(tmp_path)}, "train": train})
        b = get_backend("fsdp")()
        b.setup(plan)
        return b

    try:
        straight = backend()
        for seed in range(3):
            straight.train(make_samples(seed))
            if seed == 0:
                straight.save(1, extra={"seed": 1})
        resumed = backend()
        assert resumed.load() == {"seed": 1}
        for seed in (1, 2):
            resumed.train(make_samples(seed))
        # the offloading optimiser wrote its own state; DCP holds only the model
        assert (step_dir(tmp_path / "default", 1) / "optimizer").is_dir()
        w1 = {n: t for b in straight.export_weights(1 << 20) for n, t in b}
        w2 = {n: t for b in resumed.export_weights(1 << 20) for n, t in b}
        assert max((w1[k] - w2[k]).abs().max().item() for k in w1) <= TOL
    finally:
        teardown_distributed()
