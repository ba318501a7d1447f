"""Saving and restoring streamed optimiser state inside a checkpoint directory.

A rank's state goes to `<checkpoint>/optimizer_offload_rank<NNNNN>/`: one file per bucket (the same
byte image as on NVMe), then `manifest.json` (step counts, layout), then a `.complete` marker,
each step fsynced before the next. NVMe bucket files are immutable, so they are hard-linked when the
checkpoint is on the same filesystem (instant, no extra space) and copied otherwise. `load_state`
trusts only a directory with the marker and a layout equal to the optimiser's; it installs the
files as a new committed version, so a crash while loading leaves the previous version in force.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from miles.train.offload.checks import OffloadError
from miles.train.offload.fileio import fsync_dir, link_or_copy, read_image, write_image
from miles.train.offload.store import MANIFEST, DiskStore, read_manifest, write_manifest

if TYPE_CHECKING:
    from miles.train.offload.optimizer import OffloadedAdamW

MARKER = ".complete"


def state_dir(directory: Path, rank: int) -> Path:
    """Where rank `rank` keeps its offloaded optimiser state inside a checkpoint directory."""
    return directory / f"optimizer_offload_rank{rank:05d}"


def _ckpt_file(index: int) -> str:
    return f"bucket_{index:05d}.bin"


def save_state(opt: OffloadedAdamW, directory: Path) -> Path:
    """Write opt's committed state under directory; the marker is written last."""
    target = state_dir(directory, opt.rank)
    target.mkdir(parents=True, exist_ok=True)
    (target / MARKER).unlink(missing_ok=True)
    files = []
    if any(opt.steps):
        for b in opt.buckets:
            dst = target / _ckpt_file(b.index)
            if isinstance(opt.store, DiskStore):
                link_or_copy(opt.store.file(b.index), dst)
            else:
                write_image(dst, opt.store.images[b.index], direct=False)
            files.append(dst.name)
    write_manifest(target, {**opt.meta(list(opt.steps)), "files": files})
    (target / MARKER).write_text("")
    fsync_dir(target)
    return target


def _check_layout(opt: OffloadedAdamW, target: Path, saved: dict) -> None:
    mine = json.loads(json.dumps(opt.meta(list(opt.steps))))
    if saved.get("layout") != mine["layout"]:
        raise OffloadError(
            f"optimizer offload state in {target} has another bucket layout (saved with "
            f"train.offload_bucket_mb={saved.get('bucket_bytes', 0) / 2**20:g}, "
            f"train.offload_moment_dtype={saved.get('moment_dtype')}); resume with those values and "
            "the same model and parallelism it was saved with"
        )


def load_state(opt: OffloadedAdamW, directory: Path) -> None:
    """Install the state saved under directory into opt (files become a new committed version)."""
    target = state_dir(directory, opt.rank)
    if not (target / MARKER).exists() or not (target / MANIFEST).exists():
        raise OffloadError(
            f"optimizer offload state in {target} is incomplete (no {MARKER} marker): the save was "
            "interrupted; resume from an earlier complete checkpoint"
        )
    saved = read_manifest(target)
    _check_layout(opt, target, saved)
    sources = [target / f for f in saved["files"]]
    if isinstance(opt.store, DiskStore):
        _install_files(opt.store, sources, saved)
    elif sources:
        for b, src in zip(opt.buckets, sources, strict=True):
            read_image(src, opt.store.images[b.index], direct=False)
    else:
        for image in opt.store.images:
            image.zero_()
    opt.steps = list(saved["steps"])


def _install_files(store: DiskStore, sources: list[Path], saved: dict) -> None:
    """Link checkpoint files in as version+1 and commit them with a manifest."""
    old, new = store.version, store.version + 1
    if not sources:
        store.remove_stale()
        return
    for b, src in zip(store.buckets, sources, strict=True):
        link_or_copy(src, store.file(b.index, new))
    fsync_dir(store.root)
    files = [store.file(b.index, new).name for b in store.buckets]
    write_manifest(store.root, {**saved, "version": new, "files": files})
    store.version = new
    if old:
        for b in store.buckets:
            store.file(b.index, old).unlink(missing_ok=True)
