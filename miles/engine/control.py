"""What the engine holds, changed from other threads (HTTP handlers): weights, LoRA adapters and device
memory. `Holdings` is a part of miles/engine/scheduler.py's Scheduler (`scheduler.holdings`); each of
its calls runs on the engine thread between two steps (`EngineThread._on_engine_thread`).

The scheduler state it changes, and nothing else: the decoder's weights and adapter bank, the prefix
cache (`slots`, flushed through `_flush_locked`), the running requests (retracted or aborted), the
device memory (`pool`, `table`, `row_kv`, `graphs`, `_staging`, `released`, `_alloc_memory`) and
`weight_version`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from miles.engine.admission import check_finite
from miles.engine.speculative import split_draft

if TYPE_CHECKING:
    from miles.engine.scheduler import Scheduler


class Holdings:
    """Weights, adapters and memory of a Scheduler (module docstring)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.s = scheduler

    def load_lora(self, name: str, config: Any, tensors: dict[str, torch.Tensor], source: str) -> None:
        """Load or replace (in place) adapter `name` between two steps; its cached prefixes are dropped."""

        def run() -> None:
            self.s.decoder.lora.load(name, config, tensors, source)
            self.s.slots.flush(name, only=True)

        self.s._on_engine_thread(run)

    def unload_lora(self, name: str) -> None:
        s = self.s
        s._on_engine_thread(lambda: (s.decoder.lora.unload(name), s.slots.flush(name, only=True)))

    def update_weights(
        self, weights: dict[str, torch.Tensor], version: str | None, abort_all: bool, complete: bool = False
    ) -> None:
        """Load tensors by HF name between two steps; invalidates the prefix cache. Checked first, in the
        caller's thread (miles/engine/admission.py): a non-finite tensor is refused, and so, with
        `complete`, is a set that lacks any of the model's weights; names and shapes are checked by the
        decoder before it copies anything. A refused update changes nothing."""
        check_finite(weights, "weight update")
        self.s._on_engine_thread(lambda: self._update_weights(weights, version, abort_all, complete))

    def _update_weights(
        self, weights: dict[str, torch.Tensor], version: str | None, abort_all: bool, complete: bool
    ) -> None:
        if abort_all:
            self.s._drain_inbox()
            self.s._abort_all("aborted for a weight update")
        if self.s.speculator is not None:  # the draft's tensors (train.draft) load into the draft
            weights = self.s.speculator.take_draft_weights(weights)
        else:  # an engine without a draft ignores them
            weights = split_draft(weights)[1]
        self.s.decoder.load(weights, strict=complete)
        self.s._flush_locked()
        if version is not None:
            self.s.weight_version = str(version)

    def flush_cache(self) -> None:
        self.s._on_engine_thread(self.s._flush_locked)

    def release_memory(self) -> None:
        """Free the device memory: KV pool, slot table, CUDA graphs, and the weights (kept in pinned
        host memory, where weight updates keep landing). Running requests are retracted first."""
        self.s._on_engine_thread(self._release_memory)

    def _release_memory(self) -> None:
        s = self.s
        if s.released:
            return
        for req in reversed(s.running):
            s._retract(req)
        s._flush_locked()
        s.released = True
        if s.graphs is not None:
            s.graphs.clear()
        s.graphs, s.pool, s.table, s.row_kv = None, [], torch.empty(0), None
        s.decoder.routing_table = None
        s._staging = None
        s.decoder.offload()
        if s.decoder.device.type == "cuda":
            torch.cuda.synchronize(s.decoder.device)
            torch.cuda.empty_cache()

    def resume_memory(self) -> None:
        """Weights back on the device, a fresh (empty) KV pool; graphs are captured again on use."""
        self.s._on_engine_thread(self._resume_memory)

    def _resume_memory(self) -> None:
        if self.s.released:
            self.s.decoder.onload()
            self.s._alloc_memory()
            self.s.released = False
