"""Offload directory checks: missing, read-only, network-mounted, too small; O_DIRECT fallback."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from miles.train.offload import OffloadedAdamW, OffloadError
from miles.train.offload.checks import check_free_space, check_offload_dir, filesystem_type
from miles.train.offload.fileio import probe_direct_io


def _mounts_with(tmp_path: Path, point: Path, fstype: str) -> Path:
    """A mount table like /proc/mounts where `point` is mounted with `fstype` (NFS cannot be mounted here)."""
    real = Path("/proc/mounts").read_text()
    fake = tmp_path / "mounts"
    escaped = str(point).replace(" ", "\\040")
    fake.write_text(real + f"server:/export {escaped} {fstype} rw,relatime 0 0\n")
    return fake


def test_network_filesystem_is_refused_when_local_is_required(tmp_path):
    shared = tmp_path / "on shared"
    shared.mkdir()
    for fstype in ("nfs4", "lustre", "gpfs"):
        mounts = _mounts_with(tmp_path, shared, fstype)
        assert filesystem_type(shared / "sub", mounts) == fstype
        with pytest.raises(OffloadError, match="offload_require_local") as err:
            check_offload_dir(shared, require_local=True, mounts=str(mounts))
        assert fstype in str(err.value) and "train.offload_dir" in str(err.value)
        check_offload_dir(shared, require_local=False, mounts=str(mounts))
    check_offload_dir(tmp_path, require_local=True)  # the real mount table: a local disk


def test_missing_directory(tmp_path):
    with pytest.raises(OffloadError, match="does not exist"):
        check_offload_dir(tmp_path / "absent", require_local=True)


def _make_read_only(path: Path) -> bool:
    if os.geteuid() != 0:
        path.chmod(0o555)
        return True
    if shutil.which("chattr") is None:
        return False
    return subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0


def test_read_only_directory(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    if not _make_read_only(ro):
        pytest.skip("cannot make a directory read-only here (root without chattr +i)")
    try:
        with pytest.raises(OffloadError, match="not writable"):
            check_offload_dir(ro, require_local=True)
    finally:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(ro)], check=True)
        ro.chmod(0o755)


def test_too_little_free_space_is_found_before_the_first_step(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    check_free_space(tmp_path, free // 2)
    with pytest.raises(OffloadError, match="free but the streamed") as err:
        check_free_space(tmp_path, free + 2**40)
    assert "train.offload_dir" in str(err.value)


def test_small_tmpfs_is_refused_at_construction(tmp_path):
    """A real 1 MiB filesystem cannot hold 2 x ~1.6 MiB of state: refused before any step."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "none", str(mnt)]).returncode
    ):
        pytest.skip("cannot mount a small tmpfs here")
    try:
        params = [torch.nn.Parameter(torch.zeros(200_000))]
        with pytest.raises(OffloadError, match=r"MiB free but .* needs 3\.\d MiB"):
            OffloadedAdamW(params, mode="nvme", directory=str(mnt), require_local=True)
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_buffered_fallback_where_o_direct_is_unsupported(tmp_path, monkeypatch, caplog):
    """Without O_DIRECT (some FUSE filesystems, non-Linux) the store falls back to buffered I/O."""
    assert probe_direct_io(tmp_path) is hasattr(os, "O_DIRECT")  # this disk: O_DIRECT works
    monkeypatch.delattr(os, "O_DIRECT", raising=False)
    p = torch.nn.Parameter(torch.ones(5000))
    with caplog.at_level("INFO", logger="miles.train.offload"):
        opt = OffloadedAdamW([p], lr=0.1, mode="nvme", directory=str(tmp_path), bucket_bytes=8192)
    assert opt.store.direct is False and "buffered I/O" in caplog.text
    ref = torch.nn.Parameter(torch.ones(5000))
    ref_opt = torch.optim.AdamW([ref], lr=0.1, foreach=False)
    for _ in range(2):
        p.grad = torch.linspace(-1, 1, 5000)
        ref.grad = torch.linspace(-1, 1, 5000)
        opt.step()
        ref_opt.step()
    assert len(opt.buckets) == 5 and torch.equal(p, ref)
    opt.close()
