"""Weight updates of the embedded engine: from disk, over a torch.distributed group, and read-back.

Routes and bodies follow SGLang (UpdateWeightFromDiskReqInput, InitWeightsUpdateGroupReqInput,
UpdateWeightsFromDistributedReqInput, UpdateWeightsFromTensorReqInput, GetWeightsByNameReqInput).
Tensors are received or read while generation goes on; they are loaded between two engine steps
(Scheduler.update_weights), which also flushes the prefix cache and sets the weight version. One
update runs at a time.
"""

from __future__ import annotations

import asyncio
import binascii
import logging
import pickle
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict

from miles.engine.model import load_weights
from miles.engine.scheduler import Scheduler
from miles.weights.group import broadcast_from_trainer, destroy_update_group, init_update_group
from miles.weights.tensor import deserialize

log = logging.getLogger(__name__)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class UpdateFromDisk(_Body):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True


class InitGroup(_Body):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class UpdateFromDistributed(_Body):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None


class UpdateFromTensor(_Body):
    serialized_named_tensors: list[str]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class GetWeightsByName(_Body):
    name: str
    truncate_size: int = 100


def torch_dtype(name: str) -> torch.dtype:
    """'bfloat16' or 'torch.bfloat16' -> torch.bfloat16; ValueError for anything else."""
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}; use a torch dtype name such as 'bfloat16'")
    return dt


class WeightUpdater:
    """Holds the update groups and applies updates to the scheduler's decoder."""

    def __init__(self, scheduler: Scheduler, model_path: str):
        self.scheduler = scheduler
        self.model_path = model_path
        self.groups: dict[str, Any] = {}
        self.lock = asyncio.Lock()

    def from_disk(self, body: UpdateFromDisk) -> None:
        path = Path(body.model_path)
        if not path.is_dir():
            raise ValueError(f"model_path {body.model_path!r} is not a directory")
        weights = load_weights(path)
        self.scheduler.update_weights(weights, body.weight_version, body.abort_all_requests)
        self.model_path = str(path)

    def init_group(self, body: InitGroup) -> None:
        if body.group_name in self.groups:
            raise ValueError(f"update group {body.group_name!r} exists; destroy it first")
        if body.backend == "nccl" and self.scheduler.decoder.device.type != "cuda":
            raise ValueError("backend 'nccl' needs a CUDA engine; use backend 'gloo' on CPU")
        self.groups[body.group_name] = init_update_group(
            body.master_address,
            body.master_port,
            body.rank_offset,
            body.world_size,
            body.group_name,
            body.backend,
        )

    def from_distributed(self, body: UpdateFromDistributed) -> None:
        if not len(body.names) == len(body.dtypes) == len(body.shapes):
            raise ValueError("names, dtypes and shapes must have the same length")
        group = self.groups.get(body.group_name)
        if group is None:
            raise ValueError(f"no update group {body.group_name!r}; call /init_weights_update_group first")
        dtypes = [torch_dtype(d) for d in body.dtypes]
        dev = self.scheduler.decoder.device if torch.distributed.get_backend(group) == "nccl" else "cpu"
        received = {}
        for name, dtype, shape in zip(body.names, dtypes, body.shapes, strict=True):
            t = torch.empty(shape, dtype=dtype, device=dev)
            broadcast_from_trainer(t, group)
            received[name] = t
        self.scheduler.update_weights(received, body.weight_version, body.abort_all_requests)

    def from_tensor(self, body: UpdateFromTensor) -> None:
        """Tensors handed over by reference (CUDA IPC / shared memory) by a trainer on this host."""
        if body.load_format not in (None, "direct"):
            raise ValueError(f"load_format {body.load_format!r} is not supported; send (name, tensor) lists")
        if len(body.serialized_named_tensors) != 1:
            raise ValueError(
                "serialized_named_tensors needs exactly one entry (the embedded engine has one TP rank), "
                f"got {len(body.serialized_named_tensors)}"
            )
        try:
            named = deserialize(body.serialized_named_tensors[0])
        except (ValueError, TypeError, EOFError, pickle.UnpicklingError, binascii.Error) as e:
            raise ValueError(f"serialized_named_tensors could not be decoded: {e}") from None
        self.scheduler.update_weights(dict(named), body.weight_version, body.abort_all_requests)
        del named  # drop the sender's memory mapping before answering
        if self.scheduler.decoder.device.type == "cuda":
            torch.cuda.synchronize(self.scheduler.decoder.device)
            torch.cuda.ipc_collect()

    def get_by_name(self, body: GetWeightsByName) -> list:
        try:
            t = self.scheduler.decoder.get(body.name)
        except KeyError:
            raise ValueError(f"no weight named {body.name!r}") from None
        return t[: body.truncate_size].float().cpu().tolist()

    def add_routes(self, app: FastAPI, read_body, error) -> None:
        """Register the weight routes; `read_body(request, model)` parses, `error(msg)` answers 400."""

        async def run(fn, body) -> dict[str, Any] | Any:
            async with self.lock:
                try:
                    await asyncio.to_thread(fn, body)
                except (ValueError, RuntimeError, OSError) as e:
                    log.warning("%s failed: %s", fn.__name__, e)
                    return error(f"{fn.__name__} failed: {e}")
            return {
                "success": True,
                "message": "Succeeded to update model weights.",
                "num_paused_requests": 0,
            }

        @app.post("/update_weights_from_disk")
        async def _disk(request: Request):
            return await run(self.from_disk, await read_body(request, UpdateFromDisk))

        @app.post("/init_weights_update_group")
        async def _init(request: Request):
            return await run(self.init_group, await read_body(request, InitGroup))

        @app.post("/update_weights_from_distributed")
        async def _dist(request: Request):
            return await run(self.from_distributed, await read_body(request, UpdateFromDistributed))

        @app.post("/destroy_weights_update_group")
        async def _destroy(request: Request):
            body = await read_body(request)
            name = body.get("group_name", "weight_update_group") if isinstance(body, dict) else None
            if name not in self.groups:
                return error(f"no update group {name!r}")
            destroy_update_group(self.groups.pop(name))
            return {"success": True, "message": f"destroyed {name}"}

        @app.post("/update_weights_from_tensor")
        async def _tensor(request: Request):
            return await run(self.from_tensor, await read_body(request, UpdateFromTensor))

        @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
        async def _get(request: Request):
            body = await read_body(request, GetWeightsByName)
            try:
                return await asyncio.to_thread(self.get_by_name, body)
            except ValueError as e:
                return error(str(e))

        @app.post("/update_weight_version")
        async def _version(request: Request):
            body = await read_body(request)
            if not isinstance(body, dict) or "new_version" not in body:
                return error("give 'new_version'")
            self.scheduler.weight_version = str(body["new_version"])
            return {"success": True, "message": "weight version updated"}
