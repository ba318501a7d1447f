"""Continuous batching: one thread that admits, prefills, decodes and retires requests.

Each loop turn is one engine step:
    admit waiting requests that fit (slots, width) -> one batched prefill forward for them
    -> one batched decode forward over every running request -> retire the finished ones.
Requests join between steps and leave the moment they finish, so the batch never waits for its
slowest member. The thread around the steps (inbox, administrative calls between steps, a failing
step, health) is miles/engine/engine_thread.py.

Pause modes (as SGLang's /pause_generation): `abort` finishes every request with an abort reason;
`retract` frees the KV of running requests and puts them back in the queue (they continue after
/continue_generation by re-reading prompt + output so far); `in_place` freezes them, KV included,
so after a weight update they continue with the new weights. Every output token records the weight
version that produced it.

On CUDA a decode step replays a captured graph (miles/engine/cuda_graph.py) and the host work per
step is a handful of list operations per request plus two host-to-device copies and one readback;
prefills run eagerly, grouped so that padding a group to its longest member stays cheap.
With `overlap` (the default on CUDA) the host runs one decode step ahead of its readback; how a
decode step is recorded is the strategy held as `decoding` (miles/engine/decode_modes.py).
The calls that change what the engine holds (weights, LoRA adapters, memory) are in
miles/engine/control.py.
On CPU a decode step reads keys from the RowKV (miles/engine/kv_cache.py) in place; a request takes
the lowest free row, so the running rows stay packed at the front and the attention span is short.

Requests with SGLang's logprob or sampling options (miles/engine/options.py) change three things:
the prefix cache never supplies prompt positions whose log-probs they ask for (the prefill returns
those positions' logits after the usual last ones, miles/engine/logprobs.py); while one with
per-step options runs, steps are recorded at once (no step ahead) and its logits are shaped before
sampling (miles/engine/penalties.py); and a parallel sample waits for its prompt's prefill-only
request. Plain requests take the path above unchanged.
"""

from __future__ import annotations

import heapq
import logging
from collections import deque
from typing import Any

import numpy as np
import torch

from miles.engine.control import Holdings
from miles.engine.cuda_graph import DecodeGraphs
from miles.engine.decode_modes import InStep, StepAhead
from miles.engine.engine_thread import EngineThread
from miles.engine.kv_cache import RowKV, SlotAllocator
from miles.engine.logprobs import RowBuffers, extra_rows, output_rows, prompt_asks, record_prompt, step_rows
from miles.engine.model import Batch, Decoder
from miles.engine.options import after_record, match_limit, waits
from miles.engine.penalties import shape_logits
from miles.engine.request import (
    Request,
    RowConstants,
    abort_reason,
    prefill_batch,
    prefill_groups,
    sampling_rows,
)
from miles.engine.sampling import sample
from miles.engine.staging import Staging
from miles.quant import invariant

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")


class Scheduler(EngineThread):
    """Owns the decoder, the KV pool and every request; `run()` is the engine thread's body.

    The pool has one slot more than `max_total_tokens` (the scratch slot) and the slot table one row
    more than `max_running_requests` (the padding row, all scratch): padded rows of a captured decode
    batch write and read only there.
    """

    def __init__(
        self,
        decoder: Decoder,
        max_running_requests: int,
        max_total_tokens: int,
        max_prefill_tokens: int = 8192,
        cuda_graph: bool = True,
        cuda_graph_max_bs: int | None = None,
        cuda_graph_max_context: int = 4096,
        overlap: bool | None = None,
        stuck_timeout_s: float = 60.0,
        max_step_failures: int = 3,
    ):
        super().__init__(stuck_timeout_s, max_step_failures)
        self.decoder = decoder
        self.holdings = Holdings(self)  # weights, adapters, memory (miles/engine/control.py)
        self.max_running = max_running_requests
        self.max_total_tokens = max_total_tokens
        self.max_prefill_tokens = max_prefill_tokens
        self.max_context = min(decoder.spec.max_position_embeddings, max_total_tokens)
        on_gpu = decoder.device.type == "cuda"
        self.use_cuda_graph = cuda_graph and on_gpu
        self.overlap = on_gpu if overlap is None else overlap
        """Decode one step ahead of the readback (module docstring); on CPU only for tests."""
        self.decoding = StepAhead(self) if self.overlap else InStep(self)
        """How a decode step is recorded (miles/engine/decode_modes.py)."""
        self._staging: Staging | None = None
        self.graph_max_bs = min(cuda_graph_max_bs or max_running_requests, max_running_requests)
        self.graph_max_context = cuda_graph_max_context
        self.graph_rows = self.graph_max_bs
        """Rows of the largest captured decode step: graph_max_bs, or a speculative verify's rows
        (`capture_up_to`, miles/engine/speculative.py `fit_verify_graphs`)."""
        # decode contexts are padded to this multiple: few graph shapes on GPU, little waste on CPU
        self.context_step = 128 if on_gpu else 16
        self.graphs: DecodeGraphs | None = None
        self.row_kv: RowKV | None = None
        self.weight_version = "default"
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._cache_epoch = 0
        self._special = 0
        """Running requests with per-step options (miles/engine/options.py): their steps land at once."""
        self._rows = 0
        """Running requests that ask for log-prob rows of their output positions (top-k, token ids)."""
        self._row_buffers = RowBuffers()
        self.num_steps = 0
        self.num_token_steps = 0
        """Steps that recorded tokens (a busy engine's sign of life for /health_generate)."""
        self.slots = SlotAllocator(self.max_total_tokens)
        self.pool: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.table = torch.empty(0)
        self._free_rows: list[int] = []
        self._constants = RowConstants(max_running_requests + 1, decoder.spec.vocab_size)
        """Each row's sampling constants, for the decode steps' sampling rows."""
        self.speculator: Any = None
        """Speculative decoding with a draft model (miles/engine/speculative.py), else None."""
        self._needs_memory = True
        if self.decoder.device.type != "cpu":  # device memory at start-up, where running out shows at once
            self._alloc_memory()

    def _alloc_memory(self) -> None:
        self._needs_memory = False
        scratch = self.max_total_tokens
        self.pool = self.decoder.new_kv_pool(self.max_total_tokens + 1)
        self.slots = SlotAllocator(self.max_total_tokens)
        dev = self.decoder.device
        self.table = torch.zeros(self.max_running + 1, self.max_context, dtype=torch.int64, device=dev)
        self.table[self.max_running] = scratch
        self._free_rows = list(range(self.max_running))  # a heap: the lowest free row first
        if self.decoder.row_decode and not self.overlap:
            s = self.decoder.spec
            # rows never hold more than the pool's own size, unless that is under 256 positions a row
            cap = min(self.max_context, max(self.max_total_tokens // self.max_running, 256))
            self.row_kv = RowKV(
                s.num_layers, self.max_running, s.num_kv_heads, s.head_dim, self.decoder.dtype, cap
            )
        self.capture_up_to(self.graph_rows)

    def capture_up_to(self, rows: int) -> None:
        """Decode steps of up to `rows` rows replay CUDA graphs, each captured on its first use (a
        speculative verify's rows may pass graph_max_bs); the graphs so far are dropped."""
        self.graph_rows = rows
        if self.use_cuda_graph and not self._needs_memory:  # else `_alloc_memory` builds them
            context = min(self.graph_max_context, self.max_context)
            self.graphs = DecodeGraphs(self.decoder, self.pool, self.table, self.max_running, rows, context)

    # ---- called from other threads ----
    def run_until_idle(self) -> None:
        """In the calling thread, with no engine thread running (benchmarks, tests): take every
        submitted request and step until none is left."""
        with self.lock:
            self._drain_inbox()
            while self.step():
                pass

    def pause(self, mode: str) -> int:
        """Stop stepping (see module docstring); returns the number of requests affected."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"unknown pause mode {mode!r}; known: {', '.join(PAUSE_MODES)}")
        return self._on_engine_thread(lambda: self._pause(mode))

    def _pause(self, mode: str) -> int:
        self.paused = True
        self._drain_inbox()
        n = len(self.running) + len(self.waiting)
        if mode == "abort":
            self._abort_all("paused with mode=abort")
        elif mode == "retract":
            for req in reversed(self.running):
                self._retract(req)
        return n

    def resume(self) -> None:
        with self.lock:
            self.paused = False
        self._wake.set()

    # ---- LoRA adapters (miles/engine/lora.py) ----
    def _lora_rows(self) -> torch.Tensor | None:
        """The rows' adapter slots for a decode batch; None while no running request has an adapter, so
        the step runs the base model's forward alone (a loaded bank then costs nothing)."""
        lora = self.decoder.lora
        return None if lora is None or not lora.requests.any_in_use else lora.requests.rows

    def _lora_gone(self, req: Request) -> bool:
        """Whether the adapter of a waiting request was unloaded meanwhile (it is then finished, aborted)."""
        if req.lora is None or self.decoder.lora is None or req.lora in self.decoder.lora.slots:
            return False
        self.waiting.popleft()
        self._finish(req, {"type": "abort", "message": f"LoRA adapter {req.lora!r} was unloaded"})
        return True

    def _prefill_batch(self, group: list[Request]):
        batch = prefill_batch(group, self.table)
        if self.decoder.lora is not None and any(r.lora is not None for r in group):
            counts = [r.num_tokens - r.kv_len for r in group]
            batch.lora_slots = self.decoder.lora.requests.token_slots([r.lora for r in group], counts)
        return batch

    def stats(self) -> dict[str, Any]:
        return {
            "num_running_reqs": len(self.running),
            "num_waiting_reqs": len(self.waiting) + len(self._inbox),
            "num_free_token_slots": self.slots.num_free,
            "num_prefix_cached_tokens": self.slots.num_cached_tokens,
            "num_steps": self.num_steps,
            "paused": self.paused,
            "memory_released": self.released,
        }

    # ---- the engine thread ----
    def step(self) -> bool:
        """One engine step; False when there was nothing to do."""
        if self._needs_memory:
            self._alloc_memory()
        if self.decoding.inflight is not None:
            self._fault_point()
            if not self._would_admit() and not self._in_step(len(self.running)) and self.decoding.advance():
                self._retire()
                self.num_steps += 1
                return True
            self._land()
            self._retire()
        admitted = self._admit()
        if self.running:
            self._fault_point()
        others = [r for r in self.running if r not in admitted] if admitted else list(self.running)
        if admitted and others and self.row_kv is not None and self.speculator is None:
            self._forward_mixed(admitted, others)
        else:
            if admitted:
                self._forward(admitted)
            if others:
                self._forward(others)
        self._retire()
        self.num_steps += 1
        return bool(admitted or self.running or self.waiting and not self.paused)

    def _drain_inbox(self) -> None:
        while self._inbox:
            self.waiting.append(self._inbox.popleft())
        while self._aborts:
            rid = self._aborts.popleft()
            for req in [*self.running, *self.waiting]:
                if rid is None or req.rid == rid:
                    req.abort_requested = True
        kept = deque()
        for req in self.waiting:
            if req.abort_requested:
                self._finish(req, {"type": "abort", "message": "aborted by request"})
            else:
                kept.append(req)
        self.waiting = kept

    def _abort_all(self, message: str, status_code: int | None = None) -> None:
        for req in [*self.running, *self.waiting]:
            self._free(req)
            self._finish(req, abort_reason(message, status_code))
        self.running, self.waiting = [], deque()

    def _num_requests(self) -> int:
        return len(self.running) + len(self.waiting)

    def _drop_batch(self) -> list[Request]:
        """After a failed step: take out the batch's requests and start the KV bookkeeping afresh
        (pool contents stay; the prefix cache is lost). Waiting requests hold no slots and stay queued."""
        batch = {id(r): r for r in self.running}
        batch.update(
            (id(r), r)
            for r in (self.decoding.inflight.reqs if self.decoding.inflight else [])
            if not r.done.done()
        )
        self.decoding.inflight, self.running, self._special, self._rows = None, [], 0, 0
        for req in batch.values():
            req.slots, req.kv_len, req.row = [], 0, -1
        self.slots = SlotAllocator(self.max_total_tokens)
        self._free_rows = list(range(self.max_running))
        if self.row_kv is not None:
            self.row_kv.filled = [0] * len(self.row_kv.filled)
        self._cache_epoch += 1
        return list(batch.values())

    def _flush_locked(self) -> None:
        self.slots.flush()
        self._cache_epoch += 1

    def _admit(self) -> list[Request]:
        """Move waiting requests into the batch while width, prefill budget and slots allow."""
        admitted: list[Request] = []
        budget = self.max_prefill_tokens
        while self.waiting and len(self.running) < self.max_running and self._free_rows:
            req = self.waiting[0]
            if req.opts is not None and waits(req):
                break
            tokens = req.tokens
            if self._lora_gone(req):
                continue
            matched = self.slots.match(
                tokens, limit=len(tokens) - 1 if req.opts is None else match_limit(req), namespace=req.lora
            )
            need = len(tokens) - len(matched)
            fresh = self.slots.allocate(need) if need <= budget or not admitted else None
            if fresh is None:
                self.slots.release(matched)
                if not admitted and not self.running:
                    self.waiting.popleft()
                    self._finish(req, {"type": "abort", "message": "request does not fit in the KV cache"})
                    continue
                break
            self.running.append(self.waiting.popleft())
            budget -= need
            req.slots = matched + fresh
            req.kv_len = len(matched)
            req.cached_tokens += len(matched)
            req.cache_epoch = self._cache_epoch
            req.row = heapq.heappop(self._free_rows)
            self._constants.admit(req)
            if self.decoder.lora is not None:
                self.decoder.lora.requests.bind(req.row, req.lora)
            self._special += req.opts is not None and req.opts.per_step
            self._rows += req.opts is not None and req.opts.wants_rows
            if self.row_kv is not None:
                self.row_kv.filled[req.row] = 0
            self.table[req.row, : len(req.slots)] = torch.tensor(req.slots, device=self.table.device)
            admitted.append(req)
        return admitted

    def _grow(self, reqs: list[Request]) -> list[Request]:
        """Give each decoding request one more slot (its table entry is written by the caller),
        retracting the newest requests while the pool is full."""
        while reqs:
            fresh = self.slots.allocate(len(reqs))
            if fresh is not None:
                for req, s in zip(reqs, fresh, strict=True):
                    req.slots.append(s)
                return reqs
            victim = reqs.pop()
            if victim.num_tokens >= self.max_total_tokens:
                self._free(victim)
                self.running.remove(victim)
                self._finish(victim, {"type": "abort", "message": "sequence outgrew the KV cache"})
            else:
                self._retract(victim)
        return reqs

    def _retract(self, req: Request) -> None:
        self._free(req)
        self.running.remove(req)
        self.waiting.appendleft(req)

    def _free(self, req: Request) -> None:
        if req.row >= 0 and self.decoder.lora is not None:
            self.decoder.lora.requests.unbind(req.row, req.lora)
        if req.row >= 0:
            self.slots.release(req.slots)
            heapq.heappush(self._free_rows, req.row)
            self._special -= req.opts is not None and req.opts.per_step
            self._rows -= req.opts is not None and req.opts.wants_rows
        req.slots, req.kv_len, req.row = [], 0, -1

    def _forward(self, reqs: list[Request]) -> None:
        """Batched forwards over `reqs` (their not-yet-cached tokens), then sample one token each."""
        decode = [r for r in reqs if len(r.slots) == r.kv_len == r.num_tokens - 1]
        prefill = [r for r in reqs if len(r.slots) != r.kv_len]
        for group in prefill_groups(prefill):
            batch = self._prefill_batch(group)
            asks = prompt_asks(group)
            if asks:  # prompt log-probs: the logits of the asked positions come after the last ones
                batch.last_index = torch.cat((batch.last_index, extra_rows(asks, batch.last_index.device)))
            logits = self.decoder.forward(batch, self.pool)
            if asks:
                record_prompt(asks, logits[len(group) :])
                logits = logits[: len(group)]
            self._sample(group, logits, self._to_device(sampling_rows(group, logits.shape[1])))
            if self.speculator is not None:  # an MTP draft extends over the prefill (miles/engine/mtp.py)
                self.speculator.after_prefill(group, batch)
        if decode and self.speculator is not None:  # the requests it does not take decode below
            decode = self.speculator.step(decode)
        decode = self._grow(decode)
        if decode:
            self._decode(decode)

    def _forward_mixed(self, admitted: list[Request], running: list[Request]) -> None:
        """CPU: the new requests' prompts ride along the running requests' decode forward (one forward
        instead of two; prompts arriving one by one over HTTP would otherwise each cost a forward)."""
        decode = [r for r in running if len(r.slots) == r.kv_len == r.num_tokens - 1]
        groups = prefill_groups([r for r in admitted if len(r.slots) != r.kv_len])
        for group in groups[1:]:  # long prompts that do not pad well together: forwards of their own
            self._forward(group)
        decode = self._grow(decode)
        context = self._decode_context(max(len(r.slots) for r in decode)) if decode else 0
        if decode and groups and not prompt_asks(groups[0]) and self.row_kv.reserve(context):
            self._decode_rows(decode, context, groups[0])
        else:
            self._forward(groups[0] if groups else [])
            if decode:
                self._decode(decode)

    def _decode_context(self, longest: int) -> int:
        """The decode context for a longest request of `longest` positions: padded to `context_step`."""
        step = self.context_step
        return min(-(-longest // step) * step, self.max_context)

    def _decode_rows(self, reqs: list[Request], context: int, prefill: list[Request]) -> None:
        """CPU decode step over the RowKV (reserved for `context`), with `prefill` requests' new
        tokens in the same forward; samples one token for each of prefill + reqs."""
        self._sync_rows(reqs)
        rows = [[r.last_token for r in reqs], [len(r.slots) - 1 for r in reqs], [r.row for r in reqs]]
        head = torch.tensor(rows + [[r.slots[-1] for r in reqs]])
        self.table[head[2], head[1]] = head[3]
        batch = Batch.decode(head[0], head[1], head[2], self.table, context, self._lora_rows())
        batch.kv_rows = head[2]
        pre = self._prefill_batch(prefill) if prefill else None
        logits = self.decoder.forward_rows(batch, self.pool, self.row_kv.layers, reqs[-1].row + 1, pre)
        everyone = prefill + reqs
        ints, floats = sampling_rows(everyone, self.decoder.spec.vocab_size)
        self._sample(everyone, logits, (ints, floats))
        if self.speculator is not None:  # a plain step of a speculating engine (its gate times it)
            self.speculator.after_decode(reqs)

    def _decode(self, reqs: list[Request]) -> None:
        """One decode step: table entries, forward (graph replay when the shape is captured), sample."""
        context = self._decode_context(max(len(r.slots) for r in reqs))
        if self.row_kv is not None and self.row_kv.reserve(context):
            return self._decode_rows(reqs, context, [])
        # after _grow a decoding request's new token sits at position len(slots) - 1
        head = np.array(
            [[r.last_token for r in reqs], [len(r.slots) - 1 for r in reqs], [r.row for r in reqs],
             [r.slots[-1] for r in reqs]], dtype=np.int64,
        )  # fmt: skip
        ints, floats = self._to_device(self._constants.decode_rows(head))
        self.table[ints[2], ints[1]] = ints[3]
        self._launch_decode(reqs, ints, floats, context, head)

    def _launch_decode(
        self, reqs: list[Request], ints: torch.Tensor, floats: torch.Tensor, context: int, head: np.ndarray
    ):
        """Forward and sample on the device (`ints` = ids, positions, rows, slots, seeds, steps, top_k;
        `head` its first four rows on the host); `decoding` then records the tokens or holds them in
        flight."""
        self.decoder.hidden = None
        if self.graphs is not None and self.graphs.bucket(len(reqs), context) is not None:
            logits = self.graphs.run(ints[:3], context)
        else:
            batch = Batch.decode(ints[0], ints[1], ints[2], self.table, context, self._lora_rows())
            logits = self.decoder.forward(batch, self.pool)
        self.decoding.take(reqs, logits, ints, floats, head)
        if self.speculator is not None and self.decoding.inflight is None:  # recorded in step
            self.speculator.after_decode(reqs)

    def _in_step(self, n: int) -> bool:
        """Whether a decode step of `n` requests records its tokens before the next step: a speculating
        engine's steps of a batch it may speculate in (the gate times a plain step to its end, and the
        next step's choice needs this one's tokens), unless the gate keeps that batch plain for now."""
        sp = self.speculator
        return (
            sp is not None
            and (sp.max_batch is None or n <= sp.max_batch)
            and (sp.gate is None or not sp.gate.plain_ahead(n))
        )

    def _landed(self, step: Any) -> None:
        """A decode step recorded from flight (staging.InFlight): the speculator follows it, from the
        hidden states kept with it."""
        if self.speculator is not None:
            self.speculator.after_decode(step.reqs, step.hidden, ahead=True)

    def _would_admit(self) -> bool:
        return bool(self.waiting) and len(self.running) < self.max_running and bool(self._free_rows)

    def _land(self) -> None:
        """Record the decode step in flight, if any (waits for the device)."""
        self.decoding.land()

    def _record_rows(self, reqs: list[Request], tokens, logps, version: str, rows: Any) -> None:
        """`_record`, then the step's log-prob rows (StepRows or None) onto the requests that took a token."""
        before = [len(r.output) for r in reqs] if rows is not None else []
        self._record(reqs, tokens, logps, version)
        if rows is not None:
            after_record(reqs, before, rows.read())

    def _sync_rows(self, reqs: list[Request]) -> None:
        """CPU: order `reqs` by row (in place) and fill their RowKV rows up to the new token, which the
        forward then writes to row and pool alike."""
        reqs.sort(key=lambda r: r.row)
        filled = self.row_kv.filled
        behind = [(r.row, r.slots[:-1]) for r in reqs if filled[r.row] < len(r.slots) - 1]
        if behind:
            self.row_kv.sync(self.pool, behind)
        for r in reqs:
            filled[r.row] = len(r.slots)

    def _to_device(self, host: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.decoder.device.type != "cuda":
            return host
        if self._staging is None:
            self._staging = Staging(self.decoder.device, self.max_running + 1)
        return self._staging.put(*host)

    def _sample(self, reqs: list[Request], logits: torch.Tensor, params) -> None:
        """Sample one token per request from `logits` and record it; `params` as `_sample_on_device`.
        With requests that have per-step options in the batch, their logits are shaped first and their
        extra log-prob rows, stop strings and grammars handled (miles/engine/options.py)."""
        if self._special:
            return self._sample_with_options(reqs, logits, params)
        tokens, logps = self._sample_on_device(reqs, logits, params)
        rows = step_rows(reqs, logits) if self._rows else None
        self._record_rows(reqs, tokens.tolist(), logps.tolist(), self.weight_version, rows)

    def _sample_with_options(self, reqs: list[Request], logits: torch.Tensor, params) -> None:
        for req in reqs:  # max_new_tokens 0: the prefill was all it asked for
            if req.opts is not None and req.opts.zero_tokens and req.finish is None:
                req.finish = {"type": "length", "length": 0}
        logits = shape_logits(reqs, logits)
        tokens, logps = self._sample_on_device(reqs, logits, params)
        rows = output_rows(reqs, logits)
        before = [len(r.output) for r in reqs]
        self._record(reqs, tokens.tolist(), logps.tolist(), self.weight_version)
        after_record(reqs, before, rows)

    def _sample_on_device(self, reqs: list[Request], logits: torch.Tensor, params):
        """Tokens and log-probs [B] on the device; `params` = ([seeds, steps, top_k], [T, top_p]).
        The forward wrote the K/V of every slot the requests hold, so those count as computed."""
        for req in reqs:
            req.kv_len = len(req.slots)
        (seeds, steps, top_k), (temperature, top_p) = params
        filtered = [i for i, r in enumerate(reqs) if r.restricts_support]
        tokens, logps = sample(logits, temperature, top_p, top_k, seeds, steps, filtered_rows=filtered)
        if self.decoder.invariant is not None:  # the log-probs the trainer computes, bit for bit
            logps = invariant.token_logprobs(logits, tokens, torch.where(temperature > 0, temperature, 1.0))
        return tokens, logps

    def _record(self, reqs: list[Request], tokens: list[int], logps: list[float], version: str) -> None:
        """Append each request's sampled token and check whether it finished. Requests that finished
        or left the batch after the step was launched (overlap) drop their token."""
        max_context = self.max_context
        self.num_token_steps += 1
        for req, tok, lp in zip(reqs, tokens, logps, strict=True):
            if req.finish is not None or req.row < 0:
                continue
            out = req.output
            out.append(tok)
            req.logprobs.append(lp)
            req.versions.append(version)
            n = len(out)
            # the common case (no finish) without a call: this loop runs for every token
            if (
                req.abort_requested
                or tok in req.stop_ids
                or n >= req.params.max_new_tokens
                or n + len(req.prompt) >= max_context
            ):
                self._check_finish(req, tok)

    def _check_finish(self, req: Request, tok: int) -> None:
        if req.abort_requested:
            req.finish = {"type": "abort", "message": "aborted by request"}
        elif tok in req.stop_ids:
            req.finish = {"type": "stop", "matched": tok}
        elif len(req.output) >= req.params.max_new_tokens:
            req.finish = {"type": "length", "length": req.params.max_new_tokens}
        elif req.num_tokens >= self.max_context:
            req.finish = {"type": "length", "length": len(req.output)}

    def _retire(self) -> None:
        for req in [r for r in self.running if r.finish is not None or r.abort_requested]:
            if req.finish is None:
                req.finish = {"type": "abort", "message": "aborted by request"}
            n = len(req.tokens) - 1
            # with overlap a step in flight may hold one more slot (the last token's K/V): not cached
            if req.cache_epoch == self._cache_epoch and req.finish["type"] != "abort" and len(req.slots) >= n:
                self.slots.insert(req.tokens[:n], req.slots[:n], namespace=req.lora)
            if req.return_routed_experts:  # rows of positions start..n-1 (cached ones included)
                req.routed_experts = self.decoder.read_routing(req.slots[req.routed_experts_start_len : n])
            self._free(req)
            self.running.remove(req)
            self._finish(req, req.finish)
