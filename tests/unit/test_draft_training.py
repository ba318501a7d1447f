"""train.draft (miles/train/draft_model.py) on the FSDP backend, one rank over a real gloo group: the
policy's parameters and gradients are bit-identical with and without the draft, the draft's loss on
the rollout's tokens falls, every weight export ends with the draft's tensors (`draft.*`), and the
checkpoint brings the draft back; the config refuses what the draft cannot run with."""

from __future__ import annotations

import pytest
import torch
from mtp_oracle import check_mtp_training

from miles.cluster.distributed import teardown_distributed
from miles.config import ConfigError, resolve
from miles.sample import Sample
from miles.train import get_backend
from miles.train.draft_model import DraftTraining

PROMPT = [11, 22, 33, 44]


@pytest.fixture(scope="module", autouse=True)
def _process_group():
    yield
    teardown_distributed()


@pytest.fixture(scope="module")
def draft_model(tmp_path_factory) -> str:
    from miles.models.tiny import init_tiny

    return str(init_tiny(tmp_path_factory.mktemp("draft") / "d", seed=1, num_layers=1))


def _plan(tiny_model: str, draft: str, run_dir, with_draft: bool):
    train = {"device": "cpu", "steps": 4, "lr": 3e-3}
    if with_draft:
        train["draft"] = {"lr": 1e-2}
    return resolve({
        "model": {"path": tiny_model},
        "run": {"runs_root": str(run_dir.parent), "name": run_dir.name},
        "engine": {"speculative": {"draft_model_path": draft, "num_steps": 2}},
        "train": train,
    })  # fmt: skip


def _backend(plan, with_draft: bool):
    backend = get_backend("fsdp")()
    if with_draft:
        backend = DraftTraining(backend)
    backend.setup(plan)
    return backend


def _samples() -> list[Sample]:
    resp = [[50, 60, 70, 80], [90, 100, 110], [50, 61, 7, 8, 9]]
    return [
        Sample(0, i, PROMPT, r, [1] * len(r), [-2.0] * len(r), reward=float(i % 2))
        for i, r in enumerate(resp)
    ]


def _state(module: torch.nn.Module, grads: bool = False) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in module.named_parameters():
        t = p.grad if grads else p
        if t is not None:
            out[n] = t.full_tensor().clone() if hasattr(t, "full_tensor") else t.detach().clone()
    return out


def test_the_policy_is_bit_identical_and_the_draft_learns(tiny_model, draft_model, tmp_path) -> None:
    plain = _backend(_plan(tiny_model, draft_model, tmp_path / "plain", False), False)
    for _ in range(2):
        plain.train(_samples())
    want, want_grads = _state(plain.model), _state(plain.model, grads=True)

    plan = _plan(tiny_model, draft_model, tmp_path / "draft", True)
    backend = _backend(plan, True)
    losses = [backend.train(_samples())["draft/loss"] for _ in range(2)]
    got, got_grads = _state(backend.model), _state(backend.model, grads=True)
    assert want.keys() == got.keys() and all(torch.equal(want[n], got[n]) for n in want)
    assert want_grads.keys() == got_grads.keys() and want_grads
    assert all(torch.equal(want_grads[n], got_grads[n]) for n in want_grads)
    for _ in range(6):
        losses.append(backend.train(_samples())["draft/loss"])
    assert losses[-1] < losses[0] * 0.8, losses

    buckets = list(backend.export_weights(1 << 20))
    names = [n for b in buckets for n, _ in b]
    draft = dict(buckets[-1])
    assert all(n.startswith("draft.") for n in draft) and "draft.lm_head.weight" in draft
    assert any(n.startswith("model.layers.") for n in names)
    assert torch.equal(
        draft["draft.model.embed_tokens.weight"], backend.draft.model.model.embed_tokens.weight
    )

    backend.save(8, extra={"pos": 8})
    saved = {n: t.clone() for n, t in backend.draft.model.state_dict().items()}
    backend.train(_samples())
    assert backend.load(8) == {"pos": 8}
    assert all(torch.equal(saved[n], t) for n, t in backend.draft.model.state_dict().items())


@pytest.mark.parametrize(
    ("engine", "named"),
    [({}, "engine.speculative.algorithm=STANDALONE"), ({"kind": "sglang"}, "engine.kind=embedded")],
)
def test_what_the_draft_cannot_run_with_is_refused(engine, named) -> None:
    if engine.get("kind") == "sglang":
        engine = {**engine, "speculative": {"draft_model_path": "/tmp/d"}}
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        resolve({"engine": engine, "train": {"draft": {}}})


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory) -> str:
    from miles.models.tiny import init_tiny

    return str(init_tiny(tmp_path_factory.mktemp("mtp") / "m", seed=0, mtp=True))


def _mtp_plan(model: str, run_dir, with_draft: bool):
    train = {"device": "cpu", "steps": 4, "lr": 3e-3, "draft": {"lr": 1e-2}} if with_draft else {
        "device": "cpu", "steps": 4, "lr": 3e-3}  # fmt: skip
    return resolve({
        "model": {"path": model},
        "run": {"runs_root": str(run_dir.parent), "name": run_dir.name},
        "engine": {"speculative": {"algorithm": "NEXTN", "num_steps": 2}},
        "train": train,
    })  # fmt: skip


def test_the_mtp_layer_learns_beside_a_bit_identical_policy(mtp_model, tmp_path) -> None:
    """NEXTN: the MTP layer trains on the policy's hidden states of its own update passes."""
    plain = _backend(_mtp_plan(mtp_model, tmp_path / "plain", False), False)
    for _ in range(2):
        plain.train(_samples())
    want, want_grads = _state(plain.model), _state(plain.model, grads=True)

    backend = _backend(_mtp_plan(mtp_model, tmp_path / "mtp", True), True)
    first = [backend.train(_samples()) for _ in range(2)]
    got, got_grads = _state(backend.model), _state(backend.model, grads=True)
    assert all(torch.equal(want[n], got[n]) for n in want) and want.keys() == got.keys()
    assert want_grads and all(torch.equal(want_grads[n], got_grads[n]) for n in want_grads)
    check_mtp_training(backend, first, _samples, backend.model.config.num_hidden_layers)


def test_nextn_draft_training_on_megatron_needs_one_pipeline_stage() -> None:
    with pytest.raises(ConfigError, match=r"train\.pipeline_parallel=1"):
        resolve({"engine": {"speculative": {"algorithm": "NEXTN"}}, "model": {"tiny": {"mtp": True}},
                 "train": {"backend": "megatron", "pipeline_parallel": 2, "draft": {}}})  # fmt: skip
