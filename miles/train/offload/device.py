"""Moving bucket images between host memory and the device that computes the update.

On CPU the host image is the compute buffer: upload and download are the identity, so cpu offload
on a CPU trainer costs nothing extra, and the same pipeline code runs on both. On CUDA two device
buffers alternate: bucket n+1 is copied host->device on one stream while bucket n is updated on
the compute stream, and bucket n-1 is copied back device->host on a third stream (the host image
must be pinned for the copies to be asynchronous). Events order the three streams; `Download.wait`
blocks until a host image is safe to read (before it is written to disk).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Upload:
    """A bucket image on the compute device; `ready` makes the compute stream wait for its copy."""

    image: torch.Tensor
    event: object | None = None

    def ready(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream(self.image.device).wait_event(self.event)


@dataclass
class Download:
    """The copy of an updated bucket back to its host image; `wait` blocks until it has landed."""

    event: object | None = None

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class HostStage:
    """CPU compute: the host image is updated in place."""

    def upload(self, host: torch.Tensor) -> Upload:
        return Upload(host)

    def download(self, up: Upload, host: torch.Tensor) -> Download:
        return Download()


class CudaStage:
    """CUDA compute with two device buffers and separate copy streams in each direction."""

    def __init__(self, device: torch.device, max_nbytes: int) -> None:
        self.device = device
        self.buffers = [torch.empty(max_nbytes, dtype=torch.uint8, device=device) for _ in range(2)]
        self.h2d = torch.cuda.Stream(device)
        self.d2h = torch.cuda.Stream(device)
        self.freed: list[object | None] = [None, None]
        self.turn = 0

    def upload(self, host: torch.Tensor) -> Upload:
        slot = self.turn
        self.turn ^= 1
        dev = self.buffers[slot][: host.numel()]
        with torch.cuda.stream(self.h2d):
            if self.freed[slot] is not None:
                self.h2d.wait_event(self.freed[slot])
            dev.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.h2d)
        return Upload(dev, event)

    def download(self, up: Upload, host: torch.Tensor) -> Download:
        computed = torch.cuda.Event()
        computed.record(torch.cuda.current_stream(self.device))
        slot = 0 if up.image.data_ptr() == self.buffers[0].data_ptr() else 1
        with torch.cuda.stream(self.d2h):
            self.d2h.wait_event(computed)
            host.copy_(up.image, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.d2h)
        self.freed[slot] = done
        return Download(done)


def make_stage(device: torch.device, max_nbytes: int) -> HostStage | CudaStage:
    """The transfer stage for parameters living on `device`."""
    if device.type == "cuda":
        return CudaStage(device, max_nbytes)
    if device.type == "cpu":
        return HostStage()
    raise ValueError(f"optimizer offload supports cpu and cuda parameters, not {device.type}")
