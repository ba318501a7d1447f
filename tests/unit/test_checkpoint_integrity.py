"""The integrity record of checkpoints (miles/train/checkpoint.py), on plain files: what the marker
records, how damage of each kind is found and reported, falling back, old markers, pruning, no torch."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys

import pytest

from miles.train.checkpoint import (
    COMPLETE,
    CheckpointError,
    NoCheckpointError,
    choose,
    complete_steps,
    find_resume_step,
    mark_complete,
    read_marker,
    split_work,
    step_dir,
)


def _save(run_dir, step: int, keep_last: int = 5, size: int = 3000) -> None:
    """A fake checkpoint of `step`: nested files (with an offload-style inner marker), then sealed."""
    d = step_dir(run_dir, step)
    (d / "state").mkdir(parents=True)
    (d / "state" / "__0_0.distcp").write_bytes(bytes(range(256)) * (size // 256) + bytes([step % 256]))
    (d / "trainer.pt").write_bytes(f"trainer {step}".encode())
    (d / "optimizer" / "rank0").mkdir(parents=True)
    (d / "optimizer" / "rank0" / COMPLETE).write_text("")
    mark_complete(run_dir, step, keep_last)


def test_marker_records_every_file_with_size_and_hash(tmp_path) -> None:
    _save(tmp_path, 10)
    record = read_marker(step_dir(tmp_path, 10))
    assert record is not None and record["step"] == 10 and record["hash"] == "sha256"
    assert set(record["files"]) == {"state/__0_0.distcp", "trainer.pt", f"optimizer/rank0/{COMPLETE}"}
    shard = step_dir(tmp_path, 10) / "state" / "__0_0.distcp"
    assert record["files"]["state/__0_0.distcp"]["size"] == shard.stat().st_size
    assert record["files"]["state/__0_0.distcp"]["sha256"] == hashlib.sha256(shard.read_bytes()).hexdigest()
    assert find_resume_step(tmp_path) == (10, [])


def test_truncated_file_falls_back_and_names_both_steps_and_path(tmp_path) -> None:
    _save(tmp_path, 20)
    _save(tmp_path, 30)
    shard = step_dir(tmp_path, 30) / "state" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    step, notes = find_resume_step(tmp_path)
    assert step == 20
    assert len(notes) == 1
    assert f"checkpoint step 30 at {step_dir(tmp_path, 30)} is damaged" in notes[0]
    assert "state/__0_0.distcp has 100 bytes" in notes[0] and notes[0].endswith("resuming from step 20")


def test_changed_content_of_the_same_size_is_a_hash_mismatch(tmp_path) -> None:
    _save(tmp_path, 5)
    shard = step_dir(tmp_path, 5) / "state" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[1234] ^= 0xFF
    shard.write_bytes(bytes(data))
    choice = choose(tmp_path, 5)
    assert choice.step is None and "state/__0_0.distcp has changed (sha256 differs" in choice.error
    with pytest.raises(CheckpointError, match=r"checkpoint step 5 at .*step_5 is damaged") as info:
        choice.check()
    assert not isinstance(info.value, FileNotFoundError)  # damaged, not absent


def test_missing_file_and_unreadable_marker_are_damage(tmp_path) -> None:
    for step in (1, 2, 3):
        _save(tmp_path, step)
    (step_dir(tmp_path, 3) / "trainer.pt").unlink()
    (step_dir(tmp_path, 2) / COMPLETE).write_text('{"format": 2, "files": {"trainer.pt": {"si')
    step, notes = find_resume_step(tmp_path)
    assert step == 1
    assert "step 3" in notes[0] and "trainer.pt is missing" in notes[0]
    assert "step 2" in notes[1] and "marker is unreadable" in notes[1]
    assert all(n.endswith("resuming from step 1") for n in notes)


def test_no_usable_checkpoint(tmp_path) -> None:
    assert find_resume_step(tmp_path) == (None, [])
    with pytest.raises(NoCheckpointError, match="no complete checkpoint under"):
        choose(tmp_path).check()
    _save(tmp_path, 4)
    (step_dir(tmp_path, 4) / "trainer.pt").write_text("x")
    step, notes = find_resume_step(tmp_path)
    assert step is None and "no earlier complete checkpoint verifies" in notes[0]
    with pytest.raises(FileNotFoundError, match="no complete checkpoint verifies"):
        choose(tmp_path).check()
    with pytest.raises(FileNotFoundError, match="missing or incomplete; complete steps: 4"):
        choose(tmp_path, 9).check()


def test_old_marker_is_accepted_with_a_warning(tmp_path) -> None:
    d = step_dir(tmp_path, 7)
    d.mkdir(parents=True)
    (d / "trainer.pt").write_text("t")
    (d / COMPLETE).write_text("7\n")
    step, notes = find_resume_step(tmp_path)
    assert step == 7 and "without an integrity record" in notes[0] and str(d) in notes[0]


def test_prune_keeps_the_newest_and_drops_abandoned_and_unfinished_steps(tmp_path) -> None:
    for step in (10, 20, 30, 40):
        _save(tmp_path, step)
    step_dir(tmp_path, 25).mkdir()  # an interrupted save (no marker)
    # resumed from 20 (30 and 40 belonged to a timeline the resume abandoned); 30 is written again
    shutil.rmtree(step_dir(tmp_path, 30))
    _save(tmp_path, 30, keep_last=2)
    assert complete_steps(tmp_path) == [20, 30]
    assert not step_dir(tmp_path, 25).exists() and not step_dir(tmp_path, 40).exists()
    assert find_resume_step(tmp_path) == (30, [])


def test_split_work_covers_every_file_once_in_balanced_shares() -> None:
    files = [(f"f{i}", size) for i, size in enumerate([100, 90, 10, 10, 10, 5, 80])]
    shares = split_work(files, 3)
    assert sorted(n for share in shares for n in share) == sorted(n for n, _ in files)
    sizes = dict(files)
    loads = sorted(sum(sizes[n] for n in share) for share in shares)
    assert loads == [100, 100, 105]
    assert split_work(files, 1) == [[n for n, _ in sorted(files, key=lambda f: (-f[1], f[0]))]]


def test_marker_is_json_written_last_and_atomically(tmp_path) -> None:
    _save(tmp_path, 3)
    d = step_dir(tmp_path, 3)
    assert json.loads((d / COMPLETE).read_text())["format"] == 2
    assert not (d / (COMPLETE + ".tmp")).exists()


def test_layout_module_imports_no_torch() -> None:
    code = "import sys, miles.train.checkpoint as c; c.find_resume_step('.'); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_retention_counts_only_intact_checkpoints_and_sets_damaged_ones_aside(tmp_path) -> None:
    """The PPO case: step 12's state was truncated, the run resumed from 10 and saved 14 with
    keep_last 2: 10 and 14 are kept, 12 is set aside under a name that says so."""
    _save(tmp_path, 10)
    _save(tmp_path, 12)
    state = step_dir(tmp_path, 12) / "state" / "__0_0.distcp"
    state.write_bytes(state.read_bytes()[:100])
    assert find_resume_step(tmp_path)[0] == 10
    _save(tmp_path, 14, keep_last=2)
    assert complete_steps(tmp_path) == [10, 14]
    aside = tmp_path / "checkpoints" / "step_12.damaged"
    assert aside.is_dir() and (aside / "state" / "__0_0.distcp").stat().st_size == 100
    assert find_resume_step(tmp_path) == (14, [])
    _save(tmp_path, 16, keep_last=2)  # set-aside checkpoints are never pruned nor counted
    assert complete_steps(tmp_path) == [14, 16] and aside.is_dir()
