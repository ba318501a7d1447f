"""Scheduler calls that change what the engine holds, from other threads (HTTP handlers): weights,
LoRA adapters and device memory. Each runs on the engine thread between two steps
(`EngineThread._on_engine_thread`); a mixin of miles/engine/scheduler.py's Scheduler, whose state
(decoder, prefix cache, running requests, KV pool and graphs) it changes."""

from __future__ import annotations

from typing import Any

import torch

from miles.engine.admission import check_finite


class HoldingsControl:
    """Weights, adapters and memory of a Scheduler (module docstring)."""

    def load_lora(self, name: str, config: Any, tensors: dict[str, torch.Tensor], source: str) -> None:
        """Load or replace (in place) adapter `name` between two steps; its cached prefixes are dropped."""

        def run() -> None:
            self.decoder.lora.load(name, config, tensors, source)
            self.slots.flush(name, only=True)

        self._on_engine_thread(run)

    def unload_lora(self, name: str) -> None:
        self._on_engine_thread(lambda: (self.decoder.lora.unload(name), self.slots.flush(name, only=True)))

    def update_weights(
        self, weights: dict[str, torch.Tensor], version: str | None, abort_all: bool, complete: bool = False
    ) -> None:
        """Load tensors by HF name between two steps; invalidates the prefix cache. Checked first, in the
        caller's thread (miles/engine/admission.py): a non-finite tensor is refused, and so, with
        `complete`, is a set that lacks any of the model's weights; names and shapes are checked by the
        decoder before it copies anything. A refused update changes nothing."""
        check_finite(weights, "weight update")
        self._on_engine_thread(lambda: self._update_weights(weights, version, abort_all, complete))

    def _update_weights(
        self, weights: dict[str, torch.Tensor], version: str | None, abort_all: bool, complete: bool
    ) -> None:
        if abort_all:
            self._drain_inbox()
            self._abort_all("aborted for a weight update")
        self.decoder.load(weights, strict=complete)
        self._flush_locked()
        if version is not None:
            self.weight_version = str(version)

    def flush_cache(self) -> None:
        self._on_engine_thread(self._flush_locked)

    def release_memory(self) -> None:
        """Free the device memory: KV pool, slot table, CUDA graphs, and the weights (kept in pinned
        host memory, where weight updates keep landing). Running requests are retracted first."""
        self._on_engine_thread(self._release_memory)

    def _release_memory(self) -> None:
        if self.released:
            return
        for req in reversed(self.running):
            self._retract(req)
        self._flush_locked()
        self.released = True
        if self.graphs is not None:
            self.graphs.clear()
        self.graphs, self.pool, self.table, self.row_kv = None, [], torch.empty(0), None
        self.decoder.routing_table = None
        self._staging = None
        self.decoder.offload()
        if self.decoder.device.type == "cuda":
            torch.cuda.synchronize(self.decoder.device)
            torch.cuda.empty_cache()

    def resume_memory(self) -> None:
        """Weights back on the device, a fresh (empty) KV pool; graphs are captured again on use."""
        self._on_engine_thread(self._resume_memory)

    def _resume_memory(self) -> None:
        if self.released:
            self.decoder.onload()
            self._alloc_memory()
            self.released = False
