"""LoraTransport: each push sends only the LoRA adapters, replacing each in place in every engine.

The trainer exports `<adapter>/<PEFT saved name>` tensors (miles.lora.adapters.wire_name). Per adapter and
engine, one `/load_lora_adapter_from_tensors` under the adapter's name: the embedded engine replaces an
adapter of the same name in place (miles/engine/lora.py), so nothing is unloaded first (an unload waits
for the requests in flight, which never finish while generation is paused). The tensors travel inside
the request: by reference when every engine is on this host (`local`: CUDA IPC handles or shared
memory of one packed buffer per dtype, as TensorTransport sends full weights), else as host copies
pickled inline (a few MB, which any host's engine can take). With `check` (weights.check) they come
with `expected_checksums`, which the engine checks against the bytes it stored before answering
(hashing every tensor on both sides costs about as much as the rest of the push). Then
`/update_weight_version` gives the engines the new version, which the samples record. `pause_mode`
pauses generation once around all the loads, as the other transports do; with None the adapters change
between two engine steps while requests run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from typing import Any

from miles.lora.adapters import adapter_config, split_wire_name
from miles.weights.checksum import checksum
from miles.weights.tensor import pack, serialize, serialize_inline
from miles.weights.transport import Bucket, Site, check_pause_mode, pause_mode_of, paused


class LoraTransport:
    checks_in_push = True
    """With `check` each engine compares the bytes it stored with the sent checksums."""

    def __init__(
        self,
        engines: Sequence[Any],
        config: dict[str, Any],
        *,
        pause_mode: str | None = "in_place",
        local: bool = False,
        check: bool = False,
    ):
        check_pause_mode(pause_mode)
        self.engines, self.local, self.check = list(engines), local, check
        self.config = config
        self.pause_mode = pause_mode
        self.bytes_sent = 0

    @classmethod
    def from_plan(cls, plan: Any, site: Site) -> LoraTransport:
        """The run's adapters with their adapter_config.json, by reference when every engine is local."""
        config = adapter_config(plan.train.lora, plan.model.path)
        return cls(
            site.engines, config, pause_mode=pause_mode_of(plan), local=site.local, check=plan.weights.check
        )

    async def setup(self) -> None:
        return None

    async def push(self, buckets: Iterable[Bucket], version: str) -> None:
        adapters: dict[str, list[tuple[str, Any]]] = {}
        for bucket in buckets:
            for name, t in bucket:
                adapter, saved = split_wire_name(name)
                adapters.setdefault(adapter, []).append((saved, t.detach()))
        if self.local:  # one buffer per adapter and dtype, alive until every engine has answered
            adapters = {a: pack(named) for a, named in adapters.items()}
        bodies = [
            {
                "lora_name": adapter,
                "config_dict": self.config,
                "serialized_named_tensors": [serialize(named) if self.local else serialize_inline(named)],
                "expected_checksums": {n: checksum(t) for n, t in named} if self.check else None,
            }
            for adapter, named in adapters.items()
        ]
        self.bytes_sent = sum(t.numel() * t.element_size() for n in adapters.values() for _, t in n)
        async with paused(self.engines, self.pause_mode):
            await asyncio.gather(*(_load(e, body) for e in self.engines for body in bodies))
            await asyncio.gather(*(e.update_weight_version(str(version)) for e in self.engines))

    async def close(self) -> None:
        return None


async def _load(engine: Any, body: dict[str, Any]) -> None:
    reply = (await engine.request("POST", "/load_lora_adapter_from_tensors", body, retry=False)).json()
    if not reply.get("success"):
        raise RuntimeError(
            f"{engine.url}: loading adapter {body['lora_name']!r} failed: {reply.get('error_message')}"
        )
