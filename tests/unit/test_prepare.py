"""miles.launch.prepare: the tiny model is created once, atomically, however many submissions race."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from miles.config import ConfigError, resolve
from miles.launch.prepare import ensure_model, prepare_inputs


def _plan(path: Path, init: bool = True, seed: int = 0):
    return resolve({"model": {"path": str(path), "init_tiny_if_missing": init}, "run": {"seed": seed}})


WHOLE = {"config.json", "model.safetensors", "tokenizer.json"}


def _ensure(path: str) -> bool:
    """One racing submission: make sure the model exists, then say whether it sees all of it."""
    ensure_model(_plan(Path(path)))
    return WHOLE <= {p.name for p in Path(path).iterdir()}


def test_racing_submissions_create_the_model_once_and_whole(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "models" / "tiny"
    with multiprocessing.get_context("spawn").Pool(3) as pool:
        seen = pool.map(_ensure, [str(model)] * 3)
    assert seen == [True] * 3  # each saw a whole model
    assert capfd.readouterr().err.count("creating a tiny random model") == 1
    # nothing half-written left beside it: only the model and its lock file
    assert sorted(p.name for p in model.parent.iterdir()) == [".tiny.lock", "tiny"]
    stamp = (model / "model.safetensors").stat().st_mtime_ns
    ensure_model(_plan(model))  # exists: left alone
    assert (model / "model.safetensors").stat().st_mtime_ns == stamp


def test_a_failed_creation_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import miles.models.tiny

    def broken(out_dir: Path, seed: int = 0) -> Path:
        Path(out_dir).mkdir(parents=True)
        (Path(out_dir) / "config.json").write_text("{")  # half written, then the writer dies
        raise OSError("disk full")

    monkeypatch.setattr(miles.models.tiny, "init_tiny", broken)
    model = tmp_path / "tiny"
    with pytest.raises(OSError, match="disk full"):
        ensure_model(_plan(model))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tiny.lock"]


def test_missing_model_without_init_names_the_key(tmp_path: Path) -> None:
    plan = _plan(tmp_path / "absent", init=False)
    with pytest.raises(ConfigError, match="model.init_tiny_if_missing=true"):
        prepare_inputs(plan)
    # steps in a container may see a path the submit host does not: not an error there
    assert prepare_inputs(plan, local=False) == tmp_path / "absent"
    assert not (tmp_path / "absent").exists()


def test_bad_reward_is_caught_at_preparation(tmp_path: Path) -> None:
    plan = resolve({"model": {"path": str(tmp_path)}, "rollout": {"reward": "miles.rollout.rewards:nope"}})
    with pytest.raises(ConfigError, match="has no function 'nope'"):
        prepare_inputs(plan)
