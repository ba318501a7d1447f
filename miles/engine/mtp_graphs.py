"""CUDA graphs of the MTP draft's device-side forwards (miles/engine/mtp.py): the greedy chain
(`MtpDraft.chain`) and the layer over a round's verified rows (`MtpDraft.rows_hidden`).

Eager, each costs one-layer forwards launched from Python, a few hundred small kernels that at small
batch take longer to launch than to run, and they sit on the speculative round's path. A captured
forward launches them at once. As the decode graphs (miles/engine/cuda_graph.py): one graph per
(batch bucket, context length[, drafts]), captured the first time the shape is needed, inputs in
static buffers the replay reads (the spare rows of a bucket point at the table's padding row, whose
slots are the pool's scratch slot), the slot table, the MTP's K/V pool and weights read in place. The
target's embedding and LM head, which the MTP shares, are read in place too: a weight push or a memory
release that gives the target new tensors for them drops the graphs (`_replay` compares their
addresses).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from miles.engine.cuda_graph import batch_buckets


class _Graphs:
    """Graphs of one MTP forward over static buffers of up to `max_rows` rows."""

    def __init__(self, mtp: Any, table: torch.Tensor, pad_row: int, max_rows: int, max_context: int) -> None:
        dec = mtp.decoder
        self.mtp, self.table, self.pad_row = mtp, table, pad_row
        self.buckets, self.max_context = batch_buckets(max_rows), max_context
        self.rows = torch.full((max_rows,), pad_row, dtype=torch.int64, device=dec.device)
        self.start = torch.zeros(max_rows, dtype=torch.int64, device=dec.device)
        self.hidden = torch.zeros(max_rows, dec.spec.hidden_size, dtype=dec.dtype, device=dec.device)
        self.graphs: dict[tuple[int, ...], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.mempool = torch.cuda.graph_pool_handle()
        self._head: tuple[int, ...] = ()

    def _fits(self, n: int, context: int, table: torch.Tensor) -> bool:
        return context <= self.max_context and n <= self.buckets[-1] and table is self.table

    def _stage(self, rows: torch.Tensor, start: torch.Tensor, hidden: torch.Tensor) -> int:
        """Copy a call's rows into the static buffers; returns the bucket (spare rows: the padding row)."""
        n = rows.shape[0]
        padded = next(b for b in self.buckets if b >= n)
        self.rows[:n].copy_(rows)
        self.rows[n:padded].fill_(self.pad_row)
        self.start[:n].copy_(start)
        self.start[n:padded].zero_()
        self.hidden[:n].copy_(hidden)
        return padded

    def _replay(self, key: tuple[int, ...], forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        head = tuple(
            self.mtp.target.get(n).data_ptr() for n in ("model.embed_tokens.weight", "lm_head.weight")
        )
        if head != self._head:  # the target's embedding or head moved: graphs read the old ones
            self.graphs.clear()
            self._head = head
        if key not in self.graphs:
            self.graphs[key] = self._capture(forward)
        graph, out = self.graphs[key]
        graph.replay()
        return out

    def _capture(self, forward: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        device = self.mtp.decoder.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up: the forward's own writes, at the positions it covers
            for _ in range(2):
                forward()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            out = forward()
        return graph, out


class ChainGraphs(_Graphs):
    """Captured `MtpDraft.chain` forwards over a fixed slot table (module docstring)."""

    def __init__(self, mtp: Any, table: torch.Tensor, pad_row: int, max_batch: int, max_context: int) -> None:
        super().__init__(mtp, table, pad_row, max_batch, max_context)
        dec = mtp.decoder
        self.logits = torch.zeros(max_batch, dec.spec.vocab_size, dtype=torch.float32, device=dec.device)

    def run(self, rows, start, logits, hidden, steps: int, table: torch.Tensor, context: int) -> torch.Tensor:
        """`MtpDraft.chain` (same arguments), replayed where the shape can be captured, else eager."""
        batch = rows.shape[0]
        if not self._fits(batch, context, table):
            return self.mtp.chain(rows, start, logits, hidden, steps, table, context)
        padded = self._stage(rows, start, hidden)
        self.logits[:batch].copy_(logits)
        forward = lambda: self.mtp.chain(self.rows[:padded], self.start[:padded], self.logits[:padded],  # noqa: E731
                                         self.hidden[:padded], steps, self.table, context)  # fmt: skip
        return self._replay((padded, steps, context), forward)[:batch]


class RowsGraphs(_Graphs):
    """Captured `MtpDraft.rows_hidden` forwards (a round's k + 1 rows per request) over a fixed table."""

    def __init__(self, mtp: Any, table: torch.Tensor, pad_row: int, max_rows: int, max_context: int) -> None:
        super().__init__(mtp, table, pad_row, max_rows, max_context)
        self.ids = torch.zeros(max_rows, dtype=torch.int64, device=mtp.decoder.device)

    def run(self, ids, positions, rows, hidden, table: torch.Tensor, context: int) -> torch.Tensor:
        """`MtpDraft.rows_hidden` (same arguments), replayed where the shape can be captured, else eager."""
        n = rows.shape[0]
        if not self._fits(n, context, table):
            return self.mtp.rows_hidden(ids, positions, rows, hidden, table, context)
        padded = self._stage(rows, positions, hidden)
        self.ids[:n].copy_(ids)
        self.ids[n:padded].zero_()
        forward = lambda: self.mtp.rows_hidden(self.ids[:padded], self.start[:padded], self.rows[:padded],  # noqa: E731
                                               self.hidden[:padded], self.table, context)  # fmt: skip
        return self._replay((padded, context), forward)[:n]
