"""CUDA graphs of the MTP draft's greedy chain (miles/engine/mtp.py, `MtpDraft.chain`).

Eager, a chain of k drafts costs k - 1 one-layer forwards launched from Python, a few hundred small
kernels that at small batch take longer to launch than to run, and they sit on the speculative round's
path (the verify cannot start before the drafts exist). A captured chain launches them at once. As the
decode graphs (miles/engine/cuda_graph.py): one graph per (batch bucket, drafts, context length),
captured the first time the shape is needed, inputs in static buffers the replay reads (the spare rows
of a bucket point at the table's padding row, whose slots are the pool's scratch slot), the slot table,
the MTP's K/V pool and weights read in place. The target's embedding and LM head, which the MTP shares,
are read in place too: a weight push or a memory release that gives the target new tensors for them
drops the graphs (`run` compares their addresses).
"""

from __future__ import annotations

from typing import Any

import torch

from miles.engine.cuda_graph import batch_buckets


class ChainGraphs:
    """Captured `MtpDraft.chain` forwards over a fixed slot table (module docstring)."""

    def __init__(self, mtp: Any, table: torch.Tensor, pad_row: int, max_batch: int, max_context: int) -> None:
        dec = mtp.decoder
        self.mtp, self.table, self.pad_row = mtp, table, pad_row
        self.buckets, self.max_context = batch_buckets(max_batch), max_context
        vocab, width = dec.spec.vocab_size, dec.spec.hidden_size
        self.rows = torch.full((max_batch,), pad_row, dtype=torch.int64, device=dec.device)
        self.start = torch.zeros(max_batch, dtype=torch.int64, device=dec.device)
        self.logits = torch.zeros(max_batch, vocab, dtype=torch.float32, device=dec.device)
        self.hidden = torch.zeros(max_batch, width, dtype=dec.dtype, device=dec.device)
        self.graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.mempool = torch.cuda.graph_pool_handle()
        self._head: tuple[int, ...] = ()

    def run(self, rows, start, logits, hidden, steps: int, table: torch.Tensor, context: int) -> torch.Tensor:
        """`MtpDraft.chain` (same arguments), replayed where the shape can be captured, else eager."""
        batch = rows.shape[0]
        if context > self.max_context or batch > self.buckets[-1] or table is not self.table:
            return self.mtp.chain(rows, start, logits, hidden, steps, table, context)
        head = tuple(
            self.mtp.target.get(n).data_ptr() for n in ("model.embed_tokens.weight", "lm_head.weight")
        )
        if head != self._head:  # the target's embedding or head moved: graphs read the old ones
            self.graphs.clear()
            self._head = head
        padded = next(b for b in self.buckets if b >= batch)
        self.rows[:batch].copy_(rows)
        self.rows[batch:padded].fill_(self.pad_row)
        self.start[:batch].copy_(start)
        self.start[batch:padded].zero_()
        self.logits[:batch].copy_(logits)
        self.hidden[:batch].copy_(hidden)
        key = (padded, steps, context)
        if key not in self.graphs:
            self.graphs[key] = self._capture(padded, steps, context)
        graph, out = self.graphs[key]
        graph.replay()
        return out[:batch]

    def _forward(self, batch: int, steps: int, context: int) -> torch.Tensor:
        return self.mtp.chain(self.rows[:batch], self.start[:batch], self.logits[:batch], self.hidden[:batch],
                              steps, self.table, context)  # fmt: skip

    def _capture(self, batch: int, steps: int, context: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        device = self.mtp.decoder.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up: the chain's own writes, at the positions it drafts
            for _ in range(2):
                self._forward(batch, steps, context)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            out = self._forward(batch, steps, context)
        return graph, out
