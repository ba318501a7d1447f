"""A generation request of the embedded engine, and the host-side inputs built from a batch of them.

`Request` carries a request's prompt, sampling parameters and progress (output tokens, log-probs,
weight versions, its KV slots and scheduler row). The functions turn a list of requests into what a
forward pass takes: groups of prefills that pad well together, the packed prefill `Batch`, and the
per-request sampling rows (seeds, steps, top-k, temperature, top-p).
"""

from __future__ import annotations

import itertools
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import torch

from miles.engine.model import Batch
from miles.engine.options import RequestOptions
from miles.engine.sampling import SamplingParams


@dataclass(eq=False)
class Request:
    """One generation request and its progress."""

    rid: str
    prompt: list[int]
    params: SamplingParams
    seed: int
    stop_ids: frozenset[int]
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    """Pool slots of tokens[: len(slots)]; their K/V is computed for tokens[: kv_len]."""
    kv_len: int = 0
    row: int = -1
    cached_tokens: int = 0
    cache_epoch: int = -1
    finish: dict[str, Any] | None = None
    abort_requested: bool = False
    opts: RequestOptions | None = None
    """Logprob and sampling options beyond the plain path (miles/engine/options.py); None for most."""
    lora: str | None = None
    """The LoRA adapter the request runs with (`lora_path`), None for the base model."""
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    routed_experts: torch.Tensor | None = None
    """At finish, with return_routed_experts: int32 [rows, num_layers, top_k] expert ids of positions
    routed_experts_start_len .. num_tokens - 2 (miles/engine/replies.py encodes them)."""
    spec_verify_ct: int = 0
    """Speculative decoding (miles/engine/speculative.py): verify forwards, tokens proposed, kept."""
    spec_draft_token_num: int = 0
    spec_accept_token_num: int = 0
    done: Future = field(default_factory=Future)
    created_s: float = field(default_factory=time.monotonic)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def last_token(self) -> int:
        return self.output[-1] if self.output else self.prompt[-1]

    @cached_property
    def restricts_support(self) -> bool:
        """Sampled with top-p or top-k (the sorted path of the sampler)."""
        return self.params.temperature > 0 and (self.params.top_p < 1 or self.params.top_k > 0)


def abort_reason(message: str, status_code: int | None = None) -> dict[str, Any]:
    """SGLang's FINISH_ABORT as JSON. A `status_code` marks an engine failure: a non-streamed request
    is then answered with that HTTP status and the message (as SGLang's tokenizer manager does)."""
    reason: dict[str, Any] = {"type": "abort", "message": message}
    if status_code is not None:
        reason |= {"status_code": status_code, "err_type": "InternalServerError"}
    return reason


def sampling_rows(reqs: list[Request], vocab: int, head: list[list[int]] | None = None, ahead: int = 0):
    """Host tensors: int64 [head..., seeds, steps, top_k] and fp32 [temperature, top_p], by request
    (`ahead`: tokens of each request sampled but not yet recorded)."""
    ints = (head or []) + [
        [r.seed for r in reqs],
        [len(r.output) + ahead for r in reqs],
        [r.params.top_k if r.params.top_k > 0 else vocab for r in reqs],
    ]
    floats = [[r.params.temperature for r in reqs], [r.params.top_p for r in reqs]]
    # through NumPy: 5x faster than torch.tensor on nested lists, and this runs every decode step
    return torch.from_numpy(np.array(ints, dtype=np.int64)), torch.from_numpy(
        np.array(floats, dtype=np.float32)
    )


class RowConstants:
    """The sampling constants of the request holding each scheduler row (seed, prompt length, top-k;
    temperature, top-p), written when it is admitted, so that a decode step's sampling rows are one
    gather by row instead of five passes over its requests (`decode_rows`)."""

    def __init__(self, rows: int, vocab: int):
        self.ints = np.zeros((3, rows), dtype=np.int64)
        self.floats = np.zeros((2, rows), dtype=np.float32)
        self.vocab = vocab

    def admit(self, req: Request) -> None:
        p = req.params
        self.ints[:, req.row] = (req.seed, len(req.prompt), p.top_k if p.top_k > 0 else self.vocab)
        self.floats[:, req.row] = (p.temperature, p.top_p)

    def decode_rows(self, head: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """What `sampling_rows` gives for a decode step, from `head` int64 [4, B] (ids or indices,
        positions, rows, slots): the step of the token sampled at position p is p - len(prompt) + 1
        (one per output token before it, the one in flight included)."""
        rows = head[2]
        ints = np.empty((7, head.shape[1]), dtype=np.int64)
        ints[:4] = head
        ints[4] = self.ints[0, rows]
        np.subtract(head[1] + 1, self.ints[1, rows], out=ints[5])
        ints[6] = self.ints[2, rows]
        return torch.from_numpy(ints), torch.from_numpy(self.floats[:, rows])


def prefill_groups(reqs: list[Request]) -> list[list[Request]]:
    """Split prefills so that padding each group to its longest member at most doubles the
    attention work (query x key pairs); small prefills stay in one forward. One pass over the
    requests, longest first (each group's running longest query and useful work kept as it grows)."""
    groups: list[list[Request]] = []
    q_max = l_max = useful = 0
    for req in sorted(reqs, key=lambda r: r.num_tokens, reverse=True):
        n = req.num_tokens
        q = n - req.kv_len
        if groups:
            padded = (len(groups[-1]) + 1) * max(q_max, q) * l_max
            if padded <= max(2 * (useful + q * n), 1 << 22):
                groups[-1].append(req)
                q_max, useful = max(q_max, q), useful + q * n
                continue
        groups.append([req])
        q_max, l_max, useful = q, n, q * n
    return groups


def prefill_batch(reqs: list[Request], table: torch.Tensor) -> Batch:
    """The packed not-yet-cached tokens of `reqs`; `table[row, p]` is the slot of position p."""
    return packed_batch(
        [r.row for r in reqs], [r.kv_len for r in reqs], [r.tokens[r.kv_len :] for r in reqs],
        [len(r.slots) for r in reqs], table,
    )  # fmt: skip


def pack_tokens(rows: list[int], firsts: list[int], new: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """([3, T] int64: the packed ids of `new`, their positions (firsts[i], firsts[i] + 1, ...) and
    table rows (rows[i]), one column a token; the token count of each request)."""
    counts = np.fromiter(map(len, new), np.int64, len(new))
    total = int(counts.sum())
    host = np.empty((3, total), dtype=np.int64)
    host[0] = np.fromiter(itertools.chain.from_iterable(new), np.int64, total)
    host[1] = np.arange(total) - np.repeat(
        np.cumsum(counts) - counts - np.asarray(firsts, dtype=np.int64), counts
    )
    host[2] = np.repeat(np.asarray(rows, dtype=np.int64), counts)
    return host, counts


def packed_batch(
    rows: list[int], firsts: list[int], new: list[list[int]], lengths: list[int], table: torch.Tensor
) -> Batch:
    """A prefill-shaped batch: request i at table row rows[i] forwards tokens new[i] at positions
    firsts[i].., attending its lengths[i] first positions; built in numpy (`pack_tokens`), two
    host-to-device copies."""
    host, counts = pack_tokens(rows, firsts, new)
    starts = np.cumsum(counts) - counts
    small = np.stack((np.asarray(rows, dtype=np.int64), starts, counts))
    dev = table.device
    ids, positions, token_rows = torch.from_numpy(host).to(dev, non_blocking=True)
    rows_t, start_t, count_t = torch.from_numpy(small).to(dev, non_blocking=True)
    j = torch.arange(int(counts.max()), device=dev)
    valid = j[None, :] < count_t[:, None]
    query_index = torch.where(valid, start_t[:, None] + j[None, :], 0)
    return Batch(
        input_ids=ids,
        positions=positions,
        write_slots=table[token_rows, positions],
        query_index=query_index,
        query_pos=torch.where(valid, positions[query_index], -1),
        context_slots=table[rows_t, : max(lengths)],
        last_index=start_t + count_t - 1,
    )
