"""Large sequential reads and writes of bucket images, with O_DIRECT where the filesystem allows it.

O_DIRECT bypasses the page cache, so streamed optimiser state does not evict the host memory the
trainer needs and bandwidth numbers are the disk's, not the cache's. It needs 4 KiB-aligned buffers,
offsets and lengths; bucket images are laid out that way (see layout.py). Filesystems without it
(tmpfs, some FUSE mounts) get buffered I/O, noted once in the log. Every written file is fsynced
before it is trusted: a manifest may only name files whose bytes are on the disk.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from miles.train.offload.checks import ALIGN
from miles.train.offload.layout import aligned_empty

log = logging.getLogger("miles.train.offload")

CHUNK_BYTES = 64 * 2**20
"""Bytes per read/write system call: large enough to stream, small enough to bound one call."""


def probe_direct_io(directory: str | os.PathLike[str]) -> bool:
    """Whether an aligned O_DIRECT write works in `directory`; logs the fallback when it does not."""
    if not hasattr(os, "O_DIRECT"):
        log.info("O_DIRECT is not available on this platform; offload uses buffered I/O")
        return False
    probe = Path(directory) / f".miles_direct_probe_{os.getpid()}"
    buf = aligned_empty(ALIGN)
    buf.zero_()
    try:
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | os.O_DIRECT, 0o600)
        try:
            os.pwrite(fd, memoryview(buf.numpy()), 0)
        finally:
            os.close(fd)
    except OSError as e:
        log.info("O_DIRECT unsupported in %s (%s); offload falls back to buffered I/O", directory, e.strerror)
        return False
    finally:
        probe.unlink(missing_ok=True)
    return True


def _open(path: Path, flags: int, direct: bool) -> int:
    return os.open(path, flags | (os.O_DIRECT if direct else 0), 0o600)


def write_image(path: str | os.PathLike[str], image: torch.Tensor, direct: bool) -> None:
    """Write a uint8 host image to a new file and fsync it (aligned image required when direct)."""
    view = memoryview(image.numpy())
    fd = _open(Path(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, direct)
    try:
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done : done + CHUNK_BYTES], done)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_image(path: str | os.PathLike[str], image: torch.Tensor, direct: bool) -> None:
    """Fill a uint8 host image from a file that must have exactly the image's size."""
    path = Path(path)
    size = path.stat().st_size
    if size != image.numel():
        raise OSError(f"{path} has {size} bytes, expected {image.numel()}")
    view = memoryview(image.numpy())
    fd = _open(path, os.O_RDONLY, direct)
    try:
        done = 0
        while done < len(view):
            got = os.preadv(fd, [view[done : done + CHUNK_BYTES]], done)
            if got == 0:
                raise OSError(f"{path} ended after {done} of {len(view)} bytes")
            done += got
    finally:
        os.close(fd)


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make renames and new names in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link an immutable bucket file (same filesystem), or copy it (then fsync the copy)."""
    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        tmp = dst.with_name(dst.name + ".tmp")
        with open(src, "rb") as fin, open(tmp, "wb") as fout:
            while chunk := fin.read(CHUNK_BYTES):
                fout.write(chunk)
            fout.flush()
            os.fsync(fout.fileno())
        os.replace(tmp, dst)
