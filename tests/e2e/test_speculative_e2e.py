"""`miles train` with speculative rollout: engine.speculative names a draft model (a second tiny model of
the same tokenizer), the embedded engine gets SGLang's --speculative-* flags from it, and every step
reports `rollout/spec_accept_rate` and `rollout/spec_accept_length`, the samples training as usual.
With train.draft the draft (a STANDALONE model, or the model's own MTP layer under NEXTN) trains with the
policy and rides every weight push. The runs keep speculating in every step (`adaptive: false`): the
gate's choice is not what they test (tests/unit/test_spec_gate.py)."""

from __future__ import annotations

import pytest
from conftest import finish, miles_train

from miles.metrics import read_metrics

pytestmark = pytest.mark.slow


def test_a_run_with_a_draft_model_reports_its_acceptance(recipe, tmp_path) -> None:
    from miles.models.tiny import init_tiny

    draft = init_tiny(tmp_path / "draft", seed=1)
    path, run_dir = recipe(
        run={"name": "spec"},
        engine={"speculative": {"draft_model_path": str(draft), "num_steps": 2, "adaptive": False}},
        rollout={"max_new_tokens": 6},
        train={"steps": 3},
    )
    finish(miles_train(path))
    steps = [r for r in read_metrics(run_dir) if r.get("step", 0) > 0 and "rollout/reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert 0.0 <= r["rollout/spec_accept_rate"] <= 1.0
        assert 1.0 <= r["rollout/spec_accept_length"] <= 3.0  # kept proposals + 1 per verify, at most 2 + 1
    assert any(log.read_text().count("speculative") for log in (run_dir / "logs").glob("engine-*.log"))


def test_a_run_trains_its_draft_online(recipe, tmp_path) -> None:
    """train.draft: the draft's step beside the policy's (train/draft/loss every step) and its weights
    in every push (the engine loads the draft.* tensors; a refused push would fail the run)."""
    from miles.models.tiny import init_tiny

    draft = init_tiny(tmp_path / "draft", seed=1)
    path, run_dir = recipe(
        run={"name": "spec-online"},
        engine={"speculative": {"draft_model_path": str(draft), "num_steps": 2, "adaptive": False}},
        rollout={"max_new_tokens": 6, "group_requests": True},  # a prompt's samples in one /generate
        train={"steps": 3, "draft": {"lr": 1e-2}},
    )
    _check_draft_steps(path, run_dir)


def test_a_run_trains_the_models_mtp_layer_online(recipe, tmp_path) -> None:
    """NEXTN: the engine drafts with the model's MTP layer, the trainer trains that layer on the
    policy's hidden states (train/draft/loss every step) and pushes it with the policy's weights."""
    from miles.models.tiny import init_tiny

    model = init_tiny(tmp_path / "mtp-model", seed=0, mtp=True)
    path, run_dir = recipe(
        run={"name": "spec-mtp"},
        model={"path": str(model)},
        engine={"speculative": {"algorithm": "NEXTN", "num_steps": 2, "adaptive": False}},
        rollout={"max_new_tokens": 6},
        train={"steps": 3, "draft": {"lr": 1e-2}},
    )
    _check_draft_steps(path, run_dir)
    assert any("NEXTN" in log.read_text() for log in (run_dir / "logs").glob("engine-*.log"))


def _check_draft_steps(path, run_dir) -> None:
    """The run succeeds and each of its 3 steps reports the draft's loss and the rollout's acceptance."""
    finish(miles_train(path))
    steps = [r for r in read_metrics(run_dir) if r.get("step", 0) > 0 and "train/draft/loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["train/draft/loss"] > 0 and r["train/draft/tokens"] > 0 for r in steps)
    assert all(0.0 <= r["rollout/spec_accept_rate"] <= 1.0 for r in steps)
