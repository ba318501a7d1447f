"""Weight updates of the embedded engine: from disk, over a torch.distributed group, by tensor handle,
the update session, the weight version, and read-back.

Routes, bodies and replies follow SGLang (io_struct.py's UpdateWeightFromDiskReqInput,
InitWeightsUpdateGroupReqInput, DestroyWeightsUpdateGroupReqInput,
UpdateWeightsFromDistributedReqInput, UpdateWeightsFromTensorReqInput, BeginWeightUpdateReqInput,
EndWeightUpdateReqInput, UpdateWeightVersionReqInput, GetWeightsByNameReqInput; http_server.py's
replies). Every outcome of a weight route is `{"success": bool, "message": str, ...}`, HTTP 200 on
success and 400 on failure, a malformed body included (its message names the field); an unknown
field is refused, a field SGLang has that this engine cannot honour is refused by name when it asks
for something the engine does not do.

The update group is joined as SGLang's engines join it (miles/weights/group.py): the trainer is rank
0, this engine rank `rank_offset`; `load_format: "flattened_bucket"` receives one uint8 broadcast
holding every tensor's bytes back to back, as SGLang's FlattenedTensorBucket lays them out.

Tensors are received or read while generation goes on; they are loaded between two engine steps
(Holdings.update_weights, miles/engine/control.py), which also flushes the prefix cache and sets the weight version. One
weight operation runs at a time, in a worker thread. No HTTP call waits longer than `timeout_s` +
GRACE_S: torch's waits (store, rendezvous, each broadcast) are bounded by `timeout_s`, and a call
that still finds work unfinished at its deadline is answered 400 (the work finishes in the
background and the next weight call waits for it). A failed broadcast leaves the group's ranks out
of step, so the group is then dropped and must be joined again. /generate is served throughout.

FP8 engines (miles/engine/fp8_weights.py) take a covered `X.weight` either as the pair `X.weight`
(float8_e4m3fn) + `X.weight_scale_inv` (fp32), stored as sent, or as a plain float weight, quantised
on receipt with the contract; the distributed route receives a float8 tensor (named with its float8
dtype) as uint8 bytes (miles.weights.group.broadcast_from_trainer). /get_weights_by_name answers an
FP8 weight's dequantised values, as SGLang does.

Names under `draft.` are the speculative draft model's (`train.draft` pushes them after the policy's):
they load into the draft (its cached K/V recomputed from then on), /get_weights_by_name reads them
back from it, and an engine without a draft ignores them.

`/weights_checker` with `{"action": "checksum"}` answers SGLang's reply (utils/weight_checker.py):
per HF name the hash of the bytes the engine stores (miles.weights.checksum: sha256 of the C-order
bytes, first 8 bytes in hex), an FP8 weight as its two tensors, so a trainer compares them with the
bytes it sent; `per_gpu_checksum` over the sorted (name, hash) pairs and `per_engine_checksum` over
the ranks' (one here). SGLang hashes the dequantised value of a quantised weight instead; the bytes
are the stricter check. Its other actions (snapshot, compare, reset_tensors) answer 400.

Deliberate differences from SGLang: the begin/end session is optional (SGLang 0.5.23 requires it
around tensor and distributed updates; older trainers never open one, and this engine has no packed
weights to restore), and the prefix cache is flushed after every update whatever `flush_cache` says
(a cache computed with the old weights is never reused).
"""

from __future__ import annotations

import asyncio
import binascii
import hashlib
import logging
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator

from miles.engine.fp8_weights import load_checkpoint, quantization_of
from miles.engine.scheduler import Scheduler
from miles.engine.validation import HTTPError
from miles.weights.checksum import checksum
from miles.weights.group import broadcast_from_trainer, destroy_update_group, init_update_group
from miles.weights.tensor import deserialize

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 300.0
GRACE_S = 5.0
"""How much longer than `timeout_s` an HTTP call waits for its worker thread before answering."""
DEFAULT_GROUP = "weight_update_group"

Name = Annotated[str, StringConstraints(min_length=1)]
Dim = Annotated[int, Field(ge=0, lt=2**63)]
Selector = Literal["target", "all"]
"""SGLang's runner selector; "draft" is refused: the embedded engine has no draft model."""


class _Body(BaseModel):
    """Fields every SGLang request carries (BaseReq); accepted and unused."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    rid: str | None = None
    http_worker_ipc: str | None = None


class _Update(_Body):
    """Fields shared by the update requests."""

    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    torch_empty_cache: bool = False


class UpdateFromDisk(_Update):
    model_path: Name
    load_format: Literal["auto", "safetensors"] | None = None
    is_async: Literal[False] = False
    keep_pause: Literal[False] = False
    recapture_cuda_graph: bool = False
    """Accepted: captured graphs read the weights in place, so they always see the new ones."""
    token_step: int = 0
    manifest: None = None


class InitGroup(_Body):
    master_address: Name
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: Name = DEFAULT_GROUP
    backend: Literal["gloo", "nccl"] = "nccl"

    @model_validator(mode="after")
    def _rank_inside(self) -> InitGroup:
        if self.rank_offset >= self.world_size:
            raise ValueError(f"rank_offset {self.rank_offset} must be below world_size {self.world_size}")
        return self


class DestroyGroup(_Body):
    group_name: Name = DEFAULT_GROUP


class UpdateFromDistributed(_Update):
    names: list[Name]
    dtypes: list[str]
    shapes: list[list[Dim]]
    group_name: Name = DEFAULT_GROUP
    load_format: Literal["flattened_bucket"] | None = None
    selector: Selector = "all"

    @field_validator("dtypes")
    @classmethod
    def _known_dtypes(cls, v: list[str]) -> list[str]:
        for d in v:
            torch_dtype(d)
        return v

    @model_validator(mode="after")
    def _same_length(self) -> UpdateFromDistributed:
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError(
                f"names, dtypes and shapes must have the same length, got "
                f"{len(self.names)}, {len(self.dtypes)} and {len(self.shapes)}"
            )
        if self.load_format == "flattened_bucket" and not self.names:
            raise ValueError("names: a flattened_bucket needs at least one tensor")
        return self


class UpdateFromTensor(_Update):
    serialized_named_tensors: list[str]
    load_format: Literal["direct"] | None = None
    selector: Selector = "all"


class BeginUpdate(_Body):
    selector: Selector = "all"


class EndUpdate(_Body):
    pass


class UpdateVersion(_Body):
    new_version: Name
    abort_all_requests: bool = True


class GetWeightsByName(_Body):
    name: Name
    truncate_size: int = Field(100, ge=0)


class CheckWeights(_Body):
    """SGLang's CheckWeightsReqInput; only `action: "checksum"` is served."""

    action: str = "checksum"
    allow_quant_error: bool = False
    skip_tensor_list: list[str] | None = None
    """Substrings of names left out of the checksums."""
    selector: Selector = "all"


PARALLELISM_INFO = {
    "role": "target",
    **{k: 0 for k in ("tp_rank", "dp_rank", "pp_rank", "rank")},
    **{k: 1 for k in ("tp_size", "dp_size", "pp_size", "size")},
}
"""SGLang's ParallelismInfo of the embedded engine's one rank."""


class LoadLora(BaseModel):
    """SGLang's LoadLoRAAdapterReqInput."""

    model_config = ConfigDict(extra="ignore")
    lora_name: str
    lora_path: str
    pinned: bool = False


class LoadLoraTensors(BaseModel):
    """SGLang's LoadLoRAAdapterFromTensorsReqInput (an existing name is replaced in place)."""

    model_config = ConfigDict(extra="ignore")
    lora_name: str
    config_dict: dict[str, Any]
    serialized_named_tensors: list[str]
    pinned: bool = False
    load_format: str | None = None
    expected_checksums: dict[str, str] | None = None


class UnloadLora(BaseModel):
    """SGLang's UnloadLoRAAdapterReqInput."""

    model_config = ConfigDict(extra="ignore")
    lora_name: str


def checksum_reply(params: dict[str, torch.Tensor], skip: list[str]) -> dict[str, Any]:
    """SGLang's /weights_checker checksum reply over the stored tensors `params` (by HF name)."""
    sums = {n: checksum(t) for n, t in sorted(params.items()) if not any(s in n for s in skip)}
    overall = hashlib.sha256()
    for name, digest in sums.items():
        overall.update(name.encode())
        overall.update(digest.encode())
    per_gpu = overall.hexdigest()
    rank = {"checksums": sums, "per_gpu_checksum": per_gpu, "parallelism_info": dict(PARALLELISM_INFO)}
    per_engine = hashlib.sha256(per_gpu.encode()).hexdigest()
    return {"success": True, "message": "Success.", "ranks": [rank], "per_engine_checksum": per_engine}


def torch_dtype(name: str) -> torch.dtype:
    """'bfloat16' or 'torch.bfloat16' -> torch.bfloat16; ValueError for anything else."""
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}; use a torch dtype name such as 'bfloat16'")
    return dt


def failure(message: str, status: int = 400, **extra: Any) -> JSONResponse:
    """SGLang's answer to a failed weight call."""
    return JSONResponse({"success": False, "message": message, **extra}, status_code=status)


class WeightUpdater:
    """Holds the update groups and the session, and applies updates to the scheduler's decoder."""

    def __init__(self, scheduler: Scheduler, model_path: str, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.scheduler = scheduler
        self.model_path = model_path
        """The checkpoint the weights came from: the launch model, then the last disk update's."""
        self.timeout_s = timeout_s
        """Bound on every wait of a weight operation (rendezvous, broadcast, the HTTP call)."""
        self.groups: dict[str, Any] = {}
        self.session_open = False
        self._running: asyncio.Future | None = None

    # ---- the operations, each run in a worker thread; each returns its success message ----
    def from_disk(self, body: UpdateFromDisk) -> str:
        path = Path(body.model_path)
        if not path.is_dir():
            raise ValueError(f"model_path {body.model_path!r} is not a directory")
        weights = load_checkpoint(
            path, quantization_of(self.scheduler.decoder), getattr(self.scheduler.decoder, "scheme", None)
        )
        self.scheduler.holdings.update_weights(
            weights, body.weight_version, body.abort_all_requests, complete=True
        )
        self.model_path = body.model_path
        return "Succeeded to update model weights."

    def init_group(self, body: InitGroup) -> str:
        if body.group_name in self.groups:
            raise ValueError(f"update group {body.group_name!r} exists; destroy it first")
        if body.backend == "nccl" and self.scheduler.decoder.device.type != "cuda":
            raise ValueError("backend 'nccl' needs a CUDA engine; use backend 'gloo' on CPU")
        log.info(
            "joining update group %s at %s:%d as rank %d of %d (%s)",
            body.group_name,
            body.master_address,
            body.master_port,
            body.rank_offset,
            body.world_size,
            body.backend,
        )
        self.groups[body.group_name] = init_update_group(
            body.master_address,
            body.master_port,
            body.rank_offset,
            body.world_size,
            body.group_name,
            body.backend,
            self.timeout_s,
        )
        return "Succeeded to initialize custom process group."

    def destroy_group(self, body: DestroyGroup) -> str:
        if body.group_name not in self.groups:
            raise ValueError("The group to be destroyed does not exist.")
        destroy_update_group(self.groups.pop(body.group_name))
        return "Succeeded to destroy custom process group."

    def from_distributed(self, body: UpdateFromDistributed) -> str:
        group = self.groups.get(body.group_name)
        if group is None:
            raise ValueError(f"no update group {body.group_name!r}; call /init_weights_update_group first")
        try:
            received = self._receive(body, group)
        except Exception as e:
            destroy_update_group(self.groups.pop(body.group_name))
            raise RuntimeError(
                f"receiving the broadcast failed ({e}); update group {body.group_name!r} was dropped, "
                "join a new one with /init_weights_update_group"
            ) from e
        self.scheduler.holdings.update_weights(received, body.weight_version, body.abort_all_requests)
        message = "Succeeded to update parameter online."
        return message + (f" Weight version updated to {body.weight_version}." if body.weight_version else "")

    def _receive(self, body: UpdateFromDistributed, group: Any) -> dict[str, torch.Tensor]:
        nccl = torch.distributed.get_backend(group) == "nccl"
        dev = self.scheduler.decoder.device if nccl else torch.device("cpu")
        dtypes = [torch_dtype(d) for d in body.dtypes]
        if body.load_format != "flattened_bucket":
            received = {}
            for name, dtype, shape in zip(body.names, dtypes, body.shapes, strict=True):
                t = torch.empty(shape, dtype=dtype, device=dev)
                broadcast_from_trainer(t, group)
                received[name] = t
            return received
        spans, offset = [], 0
        for name, dtype, shape in zip(body.names, dtypes, body.shapes, strict=True):
            if offset % dtype.itemsize:
                raise ValueError(f"tensor {name!r} starts at byte {offset}, not aligned for {dtype}")
            size = torch.Size(shape).numel() * dtype.itemsize
            spans.append((name, dtype, shape, offset, offset + size))
            offset += size
        flat = torch.empty(offset, dtype=torch.uint8, device=dev)
        broadcast_from_trainer(flat, group)
        return {n: flat[a:b].view(dt).reshape(shape) for n, dt, shape, a, b in spans}

    def from_tensor(self, body: UpdateFromTensor) -> str:
        """Tensors handed over by reference (CUDA IPC / shared memory) by a trainer on this host."""
        if len(body.serialized_named_tensors) != 1:
            raise ValueError(
                "serialized_named_tensors needs exactly one entry (the embedded engine has one TP rank), "
                f"got {len(body.serialized_named_tensors)}"
            )
        try:
            named = deserialize(body.serialized_named_tensors[0])
        except (ValueError, TypeError, EOFError, pickle.UnpicklingError, binascii.Error) as e:
            raise ValueError(f"serialized_named_tensors could not be decoded: {e}") from None
        self.scheduler.holdings.update_weights(dict(named), body.weight_version, body.abort_all_requests)
        del named  # drop the sender's memory mapping before answering
        if self.scheduler.decoder.device.type == "cuda":
            torch.cuda.synchronize(self.scheduler.decoder.device)
            torch.cuda.ipc_collect()
        return "Success"

    # ---- LoRA adapters (miles/engine/lora.py), SGLang's routes ----
    def _bank(self):
        bank = self.scheduler.decoder.lora
        if bank is None:
            raise ValueError("LoRA adapters need the engine started with --enable-lora")
        return bank

    def load_lora(self, body: LoadLora) -> dict[str, Any]:
        from miles.engine.lora import read_adapter

        self._bank()
        config, tensors = read_adapter(body.lora_path)
        self.scheduler.holdings.load_lora(body.lora_name, config, tensors, body.lora_path)
        return self._loaded()

    def load_lora_tensors(self, body: LoadLoraTensors) -> dict[str, Any]:
        from miles.engine.lora import AdapterConfig

        bank = self._bank()
        if len(body.serialized_named_tensors) != 1:
            raise ValueError(
                "serialized_named_tensors needs exactly one entry (the embedded engine has one TP rank), "
                f"got {len(body.serialized_named_tensors)}"
            )
        try:
            named = dict(deserialize(body.serialized_named_tensors[0]))
        except (ValueError, TypeError, EOFError, pickle.UnpicklingError, binascii.Error) as e:
            raise ValueError(f"serialized_named_tensors could not be decoded: {e}") from None
        config = AdapterConfig.from_peft(body.config_dict)
        self.scheduler.holdings.load_lora(body.lora_name, config, named, "__tensor__")
        if body.expected_checksums:
            stored = bank.stored(body.lora_name)
            bad = sorted(
                n
                for n, want in body.expected_checksums.items()
                if n not in stored or checksum(stored[n]) != want
            )
            if bad:
                raise ValueError(
                    f"adapter {body.lora_name!r}: stored bytes differ from the expected checksums of {bad[:5]}"
                )
        return self._loaded()

    def unload_lora(self, body: UnloadLora) -> dict[str, Any]:
        self._bank()
        self.scheduler.holdings.unload_lora(body.lora_name)
        return self._loaded()

    def _loaded(self) -> dict[str, Any]:
        return {"success": True, "error_message": None, "loaded_adapters": dict(self._bank().sources)}

    async def _lora_call(self, fn: Callable[[Any], Any], body: Any) -> dict[str, Any] | JSONResponse:
        try:
            return await self.exclusive(fn, body)
        except Exception as e:
            log.warning("LoRA adapter call failed: %s", e)
            return JSONResponse(
                {"success": False, "error_message": str(e), "loaded_adapters": None}, status_code=400
            )

    def get_by_name(self, body: GetWeightsByName) -> list:
        spec = self.scheduler.speculator
        try:  # the speculative draft's tensors (`draft.*`, or the MTP layer's) are the draft's own
            t = spec.draft_weight(body.name) if spec is not None else None
            t = self.scheduler.decoder.get(body.name) if t is None else t
        except KeyError:
            raise ValueError(f"name: no weight named {body.name!r}") from None
        return t[: body.truncate_size].float().cpu().tolist()

    def check_weights(self, body: CheckWeights) -> dict[str, Any]:
        if body.action != "checksum":
            raise ValueError(
                f"Unsupported action={body.action!r}: the embedded engine serves action='checksum' only"
            )
        tensors = dict(self.scheduler.decoder.params)
        bank = self.scheduler.decoder.lora
        for name in bank.slots if bank is not None else []:  # adapters under "<adapter>/<PEFT name>"
            tensors.update({f"{name}/{n}": t for n, t in bank.stored(name).items()})
        return checksum_reply(tensors, body.skip_tensor_list or [])

    # ---- one at a time, bounded ----
    async def exclusive(self, fn: Callable[[Any], Any], body: Any) -> Any:
        """fn(body) in a worker thread once no other weight operation runs; TimeoutError past the
        call's deadline (timeout_s + GRACE_S from now, waiting for the previous operation included)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s + GRACE_S
        while self._running is not None and not self._running.done():
            left = deadline - loop.time()
            if left <= 0:
                raise TimeoutError(
                    f"another weight operation is still running after {self.timeout_s + GRACE_S:g} s; "
                    "try again once it has finished"
                )
            await asyncio.wait({self._running}, timeout=left)
        task = asyncio.ensure_future(asyncio.to_thread(fn, body))
        self._running = task
        await asyncio.wait({task}, timeout=max(0.0, deadline - loop.time()))
        if not task.done():
            task.add_done_callback(_log_late_end)
            raise TimeoutError(
                f"not finished after {self.timeout_s + GRACE_S:g} s (the engine's weight update timeout); "
                "it goes on in the background and the next weight call waits for it"
            )
        return task.result()

    async def _call(self, what: str, fn: Callable[[Any], str], body: Any) -> dict[str, Any] | JSONResponse:
        extra = {"num_paused_requests": 0} if fn == self.from_disk else {}  # as SGLang answers
        try:
            message = await self.exclusive(fn, body)
        except Exception as e:
            log.warning("%s failed: %s", what, e)
            return failure(f"Failed to {what}: {e}", **extra)
        return {"success": True, "message": message, **extra}

    def begin(self, _: BeginUpdate) -> dict[str, Any] | JSONResponse:
        if self.session_open:
            return failure("a weight-update session is already open; call /end_weight_update first")
        self.session_open = True
        return {"success": True, "message": "Success"}

    def end(self, _: EndUpdate) -> dict[str, Any] | JSONResponse:
        if not self.session_open:
            return failure("no weight-update session is open; call /begin_weight_update first")
        self.session_open = False
        return {"success": True, "message": "Success"}

    def set_version(self, body: UpdateVersion) -> dict[str, Any]:
        if body.abort_all_requests:
            self.scheduler.abort(None)
        self.scheduler.weight_version = body.new_version
        return {
            "success": True,
            "message": f"Weight version updated to {body.new_version}",
            "new_version": body.new_version,
        }

    def add_routes(self, app: FastAPI, read_body, error) -> None:
        """Register the weight routes; `read_body(request, model)` parses (raising HTTPError),
        `error(msg)` answers a failed read-back as the rest of the engine does."""
        threaded = {
            "/update_weights_from_disk": (UpdateFromDisk, self.from_disk, "update weights from disk"),
            "/init_weights_update_group": (InitGroup, self.init_group, "initialize custom process group"),
            "/destroy_weights_update_group": (DestroyGroup, self.destroy_group, "destroy process group"),
            "/update_weights_from_distributed": (
                UpdateFromDistributed,
                self.from_distributed,
                "update parameter online",
            ),
            "/update_weights_from_tensor": (UpdateFromTensor, self.from_tensor, "update weights from tensor"),
        }
        for route, (model, fn, what) in threaded.items():
            _register(app, route, model, read_body, lambda body, fn=fn, what=what: self._call(what, fn, body))
        for route, model, fn in (
            ("/load_lora_adapter", LoadLora, self.load_lora),
            ("/load_lora_adapter_from_tensors", LoadLoraTensors, self.load_lora_tensors),
            ("/unload_lora_adapter", UnloadLora, self.unload_lora),
        ):
            _register(app, route, model, read_body, lambda body, fn=fn: self._lora_call(fn, body))
        for route, model, fn in (
            ("/begin_weight_update", BeginUpdate, self.begin),
            ("/end_weight_update", EndUpdate, self.end),
            ("/update_weight_version", UpdateVersion, self.set_version),
        ):
            _register(app, route, model, read_body, lambda body, fn=fn: _now(fn, body))

        @app.api_route("/weights_checker", methods=["GET", "POST"])
        async def _check(request: Request):
            try:
                body = await read_body(request, CheckWeights)
                return await self.exclusive(self.check_weights, body)
            except HTTPError as e:
                return failure(str(e), e.status)
            except Exception as e:
                return failure(str(e))

        @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
        async def _get(request: Request):
            body = await read_body(request, GetWeightsByName)
            try:
                return await asyncio.to_thread(self.get_by_name, body)
            except ValueError as e:
                return error(str(e))


async def _now(fn: Callable[[Any], Any], body: Any) -> Any:
    return fn(body)


def _register(app: FastAPI, route: str, model: type[BaseModel], read_body, handle) -> None:
    """POST `route`: the body checked against `model`, a bad one answered as a failed weight call."""

    async def endpoint(request: Request):
        try:
            body = await read_body(request, model)
        except HTTPError as e:
            return failure(str(e), e.status)
        return await handle(body)

    app.add_api_route(route, endpoint, methods=["POST"], name=route.strip("/"))


def _log_late_end(task: asyncio.Future) -> None:
    """How a weight operation whose caller stopped waiting ended (and its exception retrieved)."""
    error = None if task.cancelled() else task.exception()
    log.warning("a weight operation answered as timed out has now ended: %s", error or "it succeeded")
