"""Checkpoints of the FSDP backend: resume with another rank count continues exactly, keep-last,
completion markers, the Hugging Face export, and integrity: a damaged newest checkpoint is skipped for
the previous one, read errors name the step, `--resume` without a usable checkpoint refuses, and the
metrics hold each step once after a resume."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from test_fsdp_ranks import probe_ids, reference_runs

from miles.train.checkpoint import COMPLETE, complete_steps, latest_complete_step, step_dir
from miles.train.fsdp.checkpoint import load_checkpoint

TOL = 1e-5
WEIGHTS_TOL = 3e-5
"""Weights of a 2-rank and a 1-rank timeline (test_fsdp.py's WEIGHTS_TOL)."""


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
        assert max((w[k] - w_ref[k]).abs().max().item() for k in w) <= WEIGHTS_TOL


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


# ---- integrity: a damaged newest checkpoint, a backend read error, resume refusal, metrics ---------


@pytest.fixture
def fsdp(tiny_model, tmp_path):
    """A factory of one-rank FSDP backends on CPU writing under tmp_path/<run>; tears down after."""
    from miles.cluster.distributed import teardown_distributed
    from miles.config import resolve
    from miles.train import get_backend

    def make(run: str = "run", **train):
        config = {
            "model": {"path": tiny_model},
            "run": {"runs_root": str(tmp_path), "name": run, "tensorboard": True},
            "train": {"device": "cpu", "lr": 1e-3, "checkpoint": {"keep_last": 3}, **train},
        }
        plan = resolve(config)
        backend = get_backend("fsdp")()
        backend.setup(plan)
        return backend, plan

    yield make
    teardown_distributed()


def _weights(backend) -> dict[str, torch.Tensor]:
    return {n: t.clone() for bucket in backend.export_weights(1 << 20) for n, t in bucket}


def _truncate_largest(directory) -> str:
    path = max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return str(path.relative_to(directory))


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.slow
def test_truncated_newest_shard_falls_back_to_the_previous_checkpoint(fsdp, caplog):
    from test_fsdp_ranks import make_samples

    from miles.train.checkpoint import CheckpointError

    backend, plan = fsdp()
    backend.train(make_samples(0))
    backend.save(10, extra={"step": 10})
    at_10 = _weights(backend)
    backend.train(make_samples(1))
    backend.save(20, extra={"step": 20})
    newest = step_dir(plan.run_dir, 20)
    shard = _truncate_largest(newest)
    assert shard.startswith("state/")  # a DCP shard, the file a resume would have failed on

    resumed, _ = fsdp()
    with caplog.at_level("WARNING", logger="miles.train.checkpoint"):
        assert resumed.load() == {"step": 10}
    assert resumed.step == 10
    assert _max_diff(_weights(resumed), at_10) == 0.0
    message = caplog.text
    assert f"checkpoint step 20 at {newest} is damaged ({shard} has" in message
    assert "resuming from step 10" in message
    with pytest.raises(CheckpointError, match=f"checkpoint step 20 at {re.escape(str(newest))} is damaged"):
        resumed.load(20)


@pytest.mark.slow
def test_backend_read_error_names_the_step_and_path(fsdp):
    from miles.train.checkpoint import CheckpointError

    backend, plan = fsdp()
    backend.save(3, extra={"step": 3})
    src = step_dir(plan.run_dir, 3)
    (src / COMPLETE).write_text("3\n")  # a marker of the first format: nothing to verify against
    (src / "trainer.pt").write_bytes((src / "trainer.pt").read_bytes()[:200])
    with pytest.raises(
        CheckpointError, match=rf"checkpoint step 3 at {re.escape(str(src))} could not be loaded: \w+"
    ):
        backend.load()


@pytest.mark.slow
def test_resume_without_a_usable_checkpoint_refuses(fsdp):
    from miles.loop.state import LoopState
    from miles.metrics import MetricsLogger, read_metrics
    from miles.train.checkpoint import NoCheckpointError

    backend, plan = fsdp()
    run_dir = Path(plan.run_dir)
    # a run that crashed at step 3 before its first checkpoint: resuming would silently start over
    log = MetricsLogger(run_dir, tensorboard=False)
    for step in range(4):
        log.log(step, {"rollout/reward_mean": 0.5})
    log.close()
    expected = rf"no usable checkpoint in {re.escape(str(run_dir))}, which holds metrics up to step 3"
    with pytest.raises(NoCheckpointError, match=rf"{expected}(?s:.*)start without --resume"):
        LoopState.restore(backend, plan, run_dir, resume=True, rank0=True)
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1, 2, 3]  # refused before touching them
    backend.save(5, extra={"step": 5, "data_index": 40})
    (step_dir(run_dir, 5) / "trainer.pt").write_bytes(b"")
    with pytest.raises(NoCheckpointError, match=r"(?s)no complete checkpoint verifies.*step 5 .*is damaged"):
        LoopState.restore(backend, plan, run_dir, resume=True, rank0=True)


@pytest.mark.slow
def test_resume_of_a_run_without_progress_is_its_first_start(fsdp):
    """Every Slurm start passes --resume: a run directory with no checkpoint and no step starts fresh."""
    from miles.loop.state import LoopState

    backend, plan = fsdp()
    run_dir = Path(plan.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 0, "eval/pass@1": 0.1}\n')  # died in the first eval
    state = LoopState.restore(backend, plan, run_dir, resume=True, rank0=True)
    assert state.step == 0 and state.logger is not None and state.logger.last_step == -1
    state.log(0, {"eval/pass@1": 0.2})
    state.close(None)


@pytest.mark.slow
def test_metrics_hold_each_step_once_after_resuming_past_a_damaged_checkpoint(fsdp):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from miles.loop.state import LoopState
    from miles.metrics import read_metrics

    backend, plan = fsdp()
    run_dir = Path(plan.run_dir)
    state = LoopState.restore(backend, plan, run_dir, resume=False, rank0=True)
    state.log(0, {"eval/pass@1": 0.0})
    for step in range(1, 6):  # checkpoints at 2 and 4; the run dies after logging step 5
        state.step = step
        state.log(step, {"rollout/reward_mean": step / 10})
        if step % 2 == 0:
            state.save(backend, None)
    state.close(None)
    _truncate_largest(step_dir(run_dir, 4))

    state = LoopState.restore(backend, plan, run_dir, resume=True, rank0=True)
    assert state.step == 2
    with pytest.raises(ValueError, match="each step is recorded once"):
        state.log(2, {"rollout/reward_mean": 9.0})
    for step in range(3, 6):
        state.log(step, {"rollout/reward_mean": step})
    state.close(None)

    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5]
    assert [r.get("rollout/reward_mean") for r in records[1:]] == [0.1, 0.2, 3.0, 4.0, 5.0]
    tb = EventAccumulator(str(run_dir / "tensorboard"))
    tb.Reload()
    rows = [(e.step, round(e.value, 6)) for e in tb.Scalars("rollout/reward_mean")]
    assert rows == [(1, 0.1), (2, 0.2), (3, 3.0), (4, 4.0), (5, 5.0)]
