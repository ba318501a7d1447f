"""The checkpoint directory layout every backend shares, and its integrity record (no torch here).

    <run_dir>/checkpoints/step_<N>/ ... backend files ... .complete

A checkpoint counts only once its `.complete` marker exists. The marker is written last, after every
rank has finished, and records each file of the checkpoint with its size and SHA-256:

    {"format": 2, "step": N, "hash": "sha256", "files": {"state/__0_0.distcp": {"size": .., "sha256": ..}}}

`seal` (collective: every rank hashes a share of the files) writes it and prunes old checkpoints;
`choose` (collective) and `find_resume_step` (one process, for a launcher) verify checkpoints newest
first and skip damaged ones (a missing, truncated or changed file, an unreadable marker) with a message
naming the step and the path. A marker of the first format holds only the step number: it is accepted
unchecked, with a warning.

The collective functions take the `torch.distributed` module as an argument (None: one process), so
that this module, which a launcher imports before any process starts, never imports torch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

COMPLETE = ".complete"
MARKER_FORMAT = 2
HASH = "sha256"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_CHUNK = 8 << 20
_HASH_THREADS = 8
_PROBLEMS_SHOWN = 3

log = logging.getLogger("miles.train.checkpoint")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used: it is damaged or the backend failed to load it."""


class NoCheckpointError(CheckpointError, FileNotFoundError):
    """The requested checkpoint does not exist, or no complete checkpoint verifies."""


def step_dir(run_dir: str | Path, step: int) -> Path:
    """`<run_dir>/checkpoints/step_<step>`."""
    return Path(run_dir) / "checkpoints" / f"step_{step}"


def _step_dirs(run_dir: str | Path) -> list[int]:
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)))


def complete_steps(run_dir: str | Path) -> list[int]:
    """Steps with a `.complete` marker (not yet verified), ascending."""
    return [s for s in _step_dirs(run_dir) if (step_dir(run_dir, s) / COMPLETE).exists()]


def latest_complete_step(run_dir: str | Path) -> int | None:
    """The newest step with a `.complete` marker, or None (see `find_resume_step` for a verified one)."""
    steps = complete_steps(run_dir)
    return steps[-1] if steps else None


# ---- the integrity record ----------------------------------------------------------------------


def checkpoint_files(directory: str | Path) -> list[tuple[str, int]]:
    """(relative path, size) of every file under a step directory except its marker, sorted."""
    root = Path(directory)
    out = []
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            if rel != COMPLETE:
                out.append((rel, path.stat().st_size))
    return sorted(out)


def hash_file(path: str | Path) -> str:
    """SHA-256 hex digest of a file, read in chunks."""
    digest = hashlib.new(HASH)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def describe_files(directory: str | Path, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """{name: {"size", "sha256"}} of files under directory (hashed on a few threads)."""
    root, names = Path(directory), list(names)

    def one(name: str) -> dict[str, Any]:
        return {"size": (root / name).stat().st_size, HASH: hash_file(root / name)}

    with ThreadPoolExecutor(max_workers=min(_HASH_THREADS, os.cpu_count() or 1)) as pool:
        return dict(zip(names, pool.map(one, names), strict=True))


def split_work(files: list[tuple[str, int]], parts: int) -> list[list[str]]:
    """Names split into `parts` shares of about equal bytes (largest first to the lightest share)."""
    shares: list[list[str]] = [[] for _ in range(parts)]
    load = [0] * parts
    for name, size in sorted(files, key=lambda f: (-f[1], f[0])):
        i = load.index(min(load))
        shares[i].append(name)
        load[i] += size
    return shares


def gather_objects(dist: Any, obj: Any) -> list[Any]:
    """Every rank's `obj` on every rank; `dist` is torch.distributed, or None for one process."""
    if dist is None or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _rank_world(dist: Any) -> tuple[int, int]:
    return (0, 1) if dist is None else (dist.get_rank(), dist.get_world_size())


def write_marker(directory: str | Path, step: int, files: dict[str, dict[str, Any]]) -> Path:
    """Write the `.complete` marker of a step directory (atomic, durable) recording `files`."""
    directory = Path(directory)
    record = {"format": MARKER_FORMAT, "step": step, "hash": HASH, "files": dict(sorted(files.items()))}
    tmp = directory / (COMPLETE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / COMPLETE)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return directory / COMPLETE


def seal(run_dir: str | Path, step: int, keep_last: int, dist: Any = None) -> None:
    """Record and mark step's checkpoint complete, then prune (collective: call on every rank after
    all of them finished writing; each hashes a share of the files, rank 0 writes the marker)."""
    rank, world = _rank_world(dist)
    out = step_dir(run_dir, step)
    listing = gather_objects(dist, checkpoint_files(out) if rank == 0 else None)[0]
    mine = describe_files(out, split_work(listing, world)[rank])
    if rank == 0:
        files = {name: entry for part in gather_objects(dist, mine) for name, entry in part.items()}
        write_marker(out, step, files)
        prune(run_dir, step, keep_last)
    else:
        gather_objects(dist, mine)


def mark_complete(run_dir: str | Path, step: int, keep_last: int) -> None:
    """One process: record every file of step's checkpoint in its marker, then prune."""
    seal(run_dir, step, keep_last, None)


def prune(run_dir: str | Path, newest: int, keep_last: int) -> None:
    """After `newest` was sealed: keep the `keep_last` newest intact checkpoints up to it; remove
    older ones, unfinished directories of earlier saves, and any step after `newest` (left by a
    timeline that a resume from an earlier checkpoint abandoned). A complete checkpoint whose files
    no longer match its marker's sizes (`quick_problem`) is damaged: it is set aside as
    `step_<N>.damaged` and not counted among the kept, so an intact older one stays."""
    complete = [s for s in complete_steps(run_dir) if s <= newest]
    intact: list[int] = []
    for s in reversed(complete):  # newest first, until enough intact ones are found
        if len(intact) == keep_last:
            break
        problem = None if s == newest else quick_problem(step_dir(run_dir, s))
        if problem is None:
            intact.append(s)
        else:
            set_aside(run_dir, s, problem)
    keep = set(intact) | {newest}
    for s in _step_dirs(run_dir):
        if s in keep:
            continue
        if s > newest:
            log.info("removing checkpoint step %d at %s: after the resumed step", s, step_dir(run_dir, s))
        shutil.rmtree(step_dir(run_dir, s), ignore_errors=True)


def quick_problem(directory: Path) -> str | None:
    """Why a complete checkpoint is damaged, checking its marker and its files' sizes only (no hashing:
    cheap enough for every save); None when it looks intact."""
    try:
        record = read_marker(directory)
    except CheckpointError as exc:
        return str(exc)
    if record is None:
        return None
    for name, entry in record["files"].items():
        try:
            size = (directory / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if size != entry["size"]:
            return f"{name} has {size} bytes, {entry['size']} were written"
    return None


def set_aside(run_dir: str | Path, step: int, problem: str) -> Path:
    """Rename a damaged checkpoint to `step_<N>.damaged` (never counted, loaded or pruned); its new path."""
    src = step_dir(run_dir, step)
    dest, n = src.with_name(src.name + ".damaged"), 1
    while dest.exists():
        n += 1
        dest = src.with_name(f"{src.name}.damaged-{n}")
    os.replace(src, dest)
    log.warning("checkpoint step %d is damaged (%s): set aside as %s", step, problem, dest)
    return dest


# ---- verification ------------------------------------------------------------------------------


def read_marker(directory: str | Path) -> dict[str, Any] | None:
    """The marker's record; None for a first-format marker (the step number alone).

    Raises CheckpointError when the marker is missing, empty or unreadable."""
    path = Path(directory) / COMPLETE
    try:
        text = path.read_text()
    except OSError as exc:
        raise CheckpointError(f"the {COMPLETE} marker cannot be read ({exc})") from exc
    if re.fullmatch(r"\s*\d+\s*", text):
        return None
    try:
        record = json.loads(text)
        files = record["files"]
        if record.get("hash") != HASH or not isinstance(files, dict):
            raise ValueError(f"unknown hash {record.get('hash')!r} or no file list")
        for entry in files.values():
            int(entry["size"]), str(entry[HASH])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"the {COMPLETE} marker is unreadable ({exc})") from exc
    return record


def _file_problem(root: Path, name: str, entry: dict[str, Any]) -> str | None:
    path = root / name
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return f"{name} is missing"
    except OSError as exc:
        return f"{name} cannot be read ({exc})"
    if size != entry["size"]:
        return f"{name} has {size} bytes, {entry['size']} were written"
    try:
        if hash_file(path) != entry[HASH]:
            return f"{name} has changed ({HASH} differs from the marker)"
    except OSError as exc:
        return f"{name} cannot be read ({exc})"
    return None


def verify_files(directory: str | Path, record: dict[str, Any], names: Iterable[str]) -> list[str]:
    """Problems of the named files against the marker's record (empty: they verify)."""
    root, files, names = Path(directory), record["files"], list(names)
    with ThreadPoolExecutor(max_workers=min(_HASH_THREADS, os.cpu_count() or 1)) as pool:
        found = pool.map(lambda n: _file_problem(root, n, files[n]), names)
        return [p for p in found if p is not None]


def _summary(problems: list[str]) -> str:
    more = len(problems) - _PROBLEMS_SHOWN
    return "; ".join(problems[:_PROBLEMS_SHOWN]) + (f"; and {more} more" if more > 0 else "")


def verify(run_dir: str | Path, step: int, dist: Any = None) -> tuple[bool, str | None]:
    """(usable, problem or warning) for step's checkpoint; collective when `dist` is given."""
    rank, world = _rank_world(dist)
    src = step_dir(run_dir, step)
    if rank == 0:
        try:
            record: dict[str, Any] | None = read_marker(src)
            outcome = (record, None)
        except CheckpointError as exc:
            outcome = (None, str(exc))
    else:
        outcome = None
    record, problem = gather_objects(dist, outcome)[0]
    if problem is not None:
        return False, problem
    if record is None:
        note = (
            f"checkpoint step {step} at {src} has a marker without an integrity record; loading it unchecked"
        )
        return True, note
    files = sorted((name, int(entry["size"])) for name, entry in record["files"].items())
    mine = verify_files(src, record, split_work(files, world)[rank])
    problems = sorted(p for part in gather_objects(dist, mine) for p in part)
    return (False, _summary(problems)) if problems else (True, None)


@dataclass(frozen=True)
class Choice:
    """The checkpoint to load, the messages about the ones skipped, or why none can be loaded."""

    step: int | None
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    missing: bool = False

    def check(self) -> int:
        """The chosen step; raises NoCheckpointError / CheckpointError when there is none."""
        if self.error is not None:
            raise (NoCheckpointError if self.missing else CheckpointError)(self.error)
        assert self.step is not None
        return self.step


def _newest_usable(run_dir: str | Path, steps: list[int], dist: Any) -> Choice:
    damaged: list[str] = []
    for step in reversed(steps):
        ok, message = verify(run_dir, step, dist)
        if ok:
            notes = [f"{bad}; resuming from step {step}" for bad in damaged]
            return Choice(step, notes + ([message] if message else []))
        damaged.append(f"checkpoint step {step} at {step_dir(run_dir, step)} is damaged ({message})")
    notes = [f"{bad}; no earlier complete checkpoint verifies" for bad in damaged]
    root = Path(run_dir) / "checkpoints"
    what = "no complete checkpoint verifies" if damaged else "no complete checkpoint"
    return Choice(None, notes, f"{what} under {root}" + "".join(f"\n  {n}" for n in notes), missing=True)


def choose(run_dir: str | Path, step: int | None = None, dist: Any = None) -> Choice:
    """Verify `step` (None: the newest complete checkpoint that verifies, skipping damaged ones).

    Collective when `dist` (torch.distributed) is given: every rank verifies a share of the files
    and all get the same Choice. Never raises for a bad checkpoint: call `.check()` on the result."""
    steps = gather_objects(dist, complete_steps(run_dir) if _rank_world(dist)[0] == 0 else None)[0]
    if step is None:
        return _newest_usable(run_dir, steps, dist)
    src = step_dir(run_dir, step)
    if step not in steps:
        found = ", ".join(map(str, steps)) or "none"
        return Choice(
            None, error=f"checkpoint {src} is missing or incomplete; complete steps: {found}", missing=True
        )
    ok, message = verify(run_dir, step, dist)
    if not ok:
        return Choice(None, error=f"checkpoint step {step} at {src} is damaged ({message})")
    return Choice(step, [message] if message else [])


def find_resume_step(run_dir: str | Path) -> tuple[int | None, list[str]]:
    """The newest step whose checkpoint verifies (None: none does) and the messages about the
    checkpoints skipped (damaged) or accepted unchecked (old marker). One process, no torch: a
    launcher calls it before starting anything; it reads every file of the chosen checkpoint."""
    choice = choose(run_dir)
    return choice.step, choice.notes


def load_error(step: int, run_dir: str | Path, exc: BaseException) -> CheckpointError:
    """The error to raise when a backend fails to read a checkpoint that verified (or had no record)."""
    return CheckpointError(
        f"checkpoint step {step} at {step_dir(run_dir, step)} could not be loaded: {type(exc).__name__}: {exc}"
    )
