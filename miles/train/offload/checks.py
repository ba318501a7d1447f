"""Up-front checks of an NVMe offload directory, run before the first optimiser step.

Each failure is an `OffloadError` (a `ConfigError`, hence a `ValueError`) whose message names the
config key to change and how: a missing or read-only directory, too little free space for the
streamed state, or a directory on a network filesystem when `train.offload_require_local` is set.
Node-locality is read from the mount table (/proc/mounts): the mount whose point is the longest
prefix of the directory's real path decides the filesystem type.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
from pathlib import Path

from miles.config import ConfigError

log = logging.getLogger("miles.train.offload")

NETWORK_FILESYSTEMS = (
    "nfs",
    "nfs4",
    "lustre",
    "gpfs",
    "beegfs",
    "cifs",
    "smb3",
    "smbfs",
    "ceph",
    "cephfs",
    "glusterfs",
    "fuse.glusterfs",
    "fuse.sshfs",
    "fuse.gcsfuse",
    "fuse.s3fs",
    "9p",
    "afs",
    "panfs",
    "wekafs",
    "pvfs2",
    "orangefs",
)
"""Filesystem types that are shared over a network, never node-local disks."""

ALIGN = 4096
"""Alignment of every offset, length and staging buffer (the O_DIRECT block size)."""


class OffloadError(ConfigError):
    """A user-fixable problem with optimiser offload; the message names the key and the fix."""


def _unescape(field: str) -> str:
    """Mount points in /proc/mounts escape space, tab, newline and backslash as octal."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def filesystem_type(path: str | os.PathLike[str], mounts: str = "/proc/mounts") -> str:
    """The type of the filesystem holding `path` ('unknown' if the mount table cannot be read)."""
    real = os.path.realpath(path)
    best, fstype = "", "unknown"
    try:
        lines = Path(mounts).read_text().splitlines()
    except OSError:
        return fstype
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        point = _unescape(parts[1])
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, fstype = point, parts[2]
    return fstype


def check_offload_dir(
    path: str | os.PathLike[str], require_local: bool, mounts: str = "/proc/mounts"
) -> None:
    """Refuse a missing, non-writable or (when required) network-mounted offload directory."""
    p = Path(path)
    if not p.is_dir():
        raise OffloadError(
            f"train.offload_dir={str(p)!r} does not exist; create it on node-local NVMe "
            "(e.g. /local/nvme/$USER/offload) or point train.offload_dir at an existing directory"
        )
    fstype = filesystem_type(p, mounts)
    if require_local and (fstype in NETWORK_FILESYSTEMS or fstype.startswith("nfs")):
        raise OffloadError(
            f"train.offload_dir={str(p)!r} is on a {fstype} filesystem, which is shared over the "
            "network; point train.offload_dir at node-local NVMe, or set "
            "train.offload_require_local=false to stream over the network anyway"
        )
    probe = p / f".miles_write_probe_{os.getpid()}"
    try:
        probe.write_bytes(b"\0" * ALIGN)
        probe.unlink()
    except OSError as e:
        raise OffloadError(
            f"train.offload_dir={str(p)!r} is not writable ({os.strerror(e.errno or errno.EIO)}); "
            "point train.offload_dir at a writable node-local directory"
        ) from None


def _human(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def check_free_space(path: str | os.PathLike[str], need_bytes: int) -> None:
    """Refuse to start when the filesystem cannot hold the streamed state (given in bytes)."""
    free = shutil.disk_usage(path).free
    if free < need_bytes:
        raise OffloadError(
            f"train.offload_dir={str(path)!r} has {_human(free)} free but the streamed optimiser "
            f"state needs {_human(need_bytes)} (two versions of every bucket during a step); "
            "free space there, point train.offload_dir at a larger disk, or use "
            "train.offload_moment_dtype=bf16 to halve the moments"
        )
