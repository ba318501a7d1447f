"""Where bucket images live between steps: pinned host memory (cpu) or versioned files on NVMe (nvme).

Both stores hand out host images one bucket at a time (`acquire`), take them back once updated
(`release`) and close a step with `commit`. MemoryStore keeps every image resident and updates it
in place. DiskStore keeps only a few reusable 4 KiB-aligned staging images and runs a pipeline:
a reader thread fills images ahead of the compute (bucket n+1, n+2), the main thread updates bucket
n, and a writer thread writes bucket n-1, so disk reads, writes and the update overlap.

Crash safety of DiskStore: bucket files are immutable and versioned (`bucket_00003.v7.bin`). Step
k+1 writes every bucket as version k+1 next to version k, fsyncs each file, and only then
atomically replaces `manifest.json` (write to a temp name, fsync, rename, fsync the directory).
A crash at any point leaves a manifest naming a complete, consistent version; files not named by
the manifest are never read and are removed on the next start. Two versions coexist during a step,
which is why the free-space check asks for twice the state size. Immutable files also let a
checkpoint hard-link them instead of copying.
"""

from __future__ import annotations

import json
import os
import queue
import re
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from miles.train.offload.device import Download
from miles.train.offload.fileio import fsync_dir, read_image, write_image
from miles.train.offload.layout import Bucket, aligned_empty

MANIFEST = "manifest.json"
_OWN_FILE = re.compile(r"^(bucket_\d+\.v\d+\.bin|manifest\.json(\.tmp)?)$")


def bucket_file(index: int, version: int) -> str:
    """The file name of bucket `index` at state version `version`."""
    return f"bucket_{index:05d}.v{version}.bin"


def write_manifest(directory: Path, manifest: dict) -> None:
    """Atomically replace directory/manifest.json (temp file, fsync, rename, fsync directory)."""
    tmp = directory / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST)
    fsync_dir(directory)


def read_manifest(directory: Path) -> dict:
    """The manifest of a state directory."""
    return json.loads((directory / MANIFEST).read_text())


class MemoryStore:
    """Every bucket image resident in (pinned, when CUDA computes) host memory."""

    def __init__(self, buckets: list[Bucket], pin: bool) -> None:
        self.buckets = buckets
        self.images = [aligned_empty(b.nbytes, pin).zero_() for b in buckets]
        self.pending: list[Download] = []

    def begin(self) -> None:
        self.pending = []

    def acquire(self, index: int) -> torch.Tensor:
        return self.images[index]

    def release(self, index: int, image: torch.Tensor, landed: Download) -> None:
        self.pending.append(landed)

    def commit(self, meta: dict) -> None:
        for landed in self.pending:
            landed.wait()
        self.pending = []

    def abort(self) -> None:
        self.commit({})

    def close(self) -> None:
        self.images = []


class IOStats:
    """Bytes moved and seconds spent by the I/O threads (for benchmarks)."""

    def __init__(self) -> None:
        self.read_bytes = self.write_bytes = 0
        self.read_s = self.write_s = 0.0


class DiskStore:
    """Versioned bucket files on node-local disk, streamed through a few aligned staging images."""

    def __init__(self, root: Path, buckets: list[Bucket], direct: bool, staging: int, pin: bool) -> None:
        self.root = root
        self.buckets = buckets
        self.direct = direct
        self.version = 0
        self.stats = IOStats()
        size = max((b.nbytes for b in buckets), default=0)
        self.free: queue.Queue[torch.Tensor] = queue.Queue()
        for _ in range(staging):
            self.free.put(aligned_empty(size, pin))
        self.staging = staging
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="offload-read")
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="offload-write")
        self.reads: dict[int, Future] = {}
        self.held: dict[int, torch.Tensor] = {}
        self.writes: list[Future] = []
        self.next_read = 0

    def remove_stale(self) -> None:
        """Delete every file this store owns in its directory (a fresh start)."""
        for p in self.root.iterdir():
            if _OWN_FILE.match(p.name):
                p.unlink()
        self.version = 0

    def file(self, index: int, version: int | None = None) -> Path:
        """The file of a bucket at `version` (default: the committed one)."""
        return self.root / bucket_file(index, self.version if version is None else version)

    def begin(self) -> None:
        self.reads, self.writes, self.held, self.next_read = {}, [], {}, 0

    def _read(self, index: int, full: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            part = full[: self.buckets[index].nbytes]
            if self.version == 0:
                part.zero_()
            else:
                read_image(self.file(index), part, self.direct)
                self.stats.read_bytes += part.numel()
        except BaseException:
            self.free.put(full)
            raise
        self.stats.read_s += time.perf_counter() - t0
        return full

    def _prefetch(self, upto: int, block_for: int) -> None:
        """Start reads up to bucket `upto`; wait for a free staging image only up to `block_for`."""
        while self.next_read <= min(upto, len(self.buckets) - 1):
            i = self.next_read
            try:
                full = self.free.get(block=i <= block_for)
            except queue.Empty:
                return
            self.reads[i] = self.reader.submit(self._read, i, full)
            self.next_read += 1

    def acquire(self, index: int) -> torch.Tensor:
        self._prefetch(index + self.staging - 2, block_for=index)
        self._raise_write_errors()
        full = self.reads.pop(index).result()
        self.held[index] = full
        return full[: self.buckets[index].nbytes]

    def _write(self, index: int, full: torch.Tensor, landed: Download) -> None:
        try:
            landed.wait()
            t0 = time.perf_counter()
            part = full[: self.buckets[index].nbytes]
            write_image(self.file(index, self.version + 1), part, self.direct)
            self.stats.write_s += time.perf_counter() - t0
            self.stats.write_bytes += part.numel()
        finally:
            self.free.put(full)

    def release(self, index: int, image: torch.Tensor, landed: Download) -> None:
        self.writes.append(self.writer.submit(self._write, index, self.held.pop(index), landed))
        self._prefetch(index + self.staging - 1, block_for=-1)

    def _raise_write_errors(self) -> None:
        for w in self.writes:
            if w.done() and w.exception() is not None:
                raise w.exception()

    def _drain(self) -> list[BaseException]:
        """Wait for all in-flight I/O, return staging images to the pool, collect errors."""
        errors = []
        for fut in self.reads.values():
            if fut.exception() is None:
                self.free.put(fut.result())
            else:
                errors.append(fut.exception())
        errors += [w.exception() for w in self.writes if w.exception() is not None]
        for full in self.held.values():
            self.free.put(full)
        self.reads, self.writes, self.held = {}, [], {}
        return errors

    def commit(self, meta: dict) -> None:
        """Wait for every write, then publish version+1 with a manifest and drop the old files."""
        errors = self._drain()
        if errors:
            raise errors[0]
        old = self.version
        files = [bucket_file(b.index, old + 1) for b in self.buckets]
        write_manifest(self.root, {**meta, "version": old + 1, "files": files})
        self.version = old + 1
        if old:
            for b in self.buckets:
                self.file(b.index, old).unlink(missing_ok=True)

    def abort(self) -> None:
        """Finish in-flight I/O after a failed step; the manifest still names the last version."""
        self._drain()

    def close(self) -> None:
        self.reader.shutdown(wait=True)
        self.writer.shutdown(wait=True)
