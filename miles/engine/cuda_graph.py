"""CUDA graphs for the decode step: one captured forward per (batch bucket, context bucket, whether a
running request uses a LoRA adapter: without, the base model's forward alone).

A decode step launches a few hundred small kernels (24 layers x ~15 ops for a 0.5B model); launched
one by one from Python they, not the GPU, set the step time. Replaying a captured graph launches
them all at once. A graph fixes its shapes and addresses, so:
- inputs live in one static buffer [3, max_batch] (token ids, positions, table rows) that each
  step overwrites; a batch of B requests runs the graph of the smallest batch bucket >= B, the
  spare rows pointing at the table's padding row, whose slots are the pool's scratch slot (their
  K/V writes land there and they attend to it alone);
- the context length is padded to a multiple of the scheduler's `context_step` (the decoder masks
  keys past each request's position), and graphs exist only up to `max_context`;
- the weights, the KV pool and the slot table are read in place, so they must not be reallocated
  while graphs exist (weight updates copy in place; releasing memory drops the graphs).
Graphs are captured lazily, the first time a shape is needed, and share one memory pool: every
replay's output is consumed before the next replay, so their intermediates may overlap. Shapes
outside the captured set run eagerly with the same code.
"""

from __future__ import annotations

import torch

from miles.engine.model import Batch, Decoder


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 to 64, of 16 to 256, of 32 beyond; always ending at max_batch."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b = b * 2 if b < 8 else b + (8 if b < 64 else 16 if b < 256 else 32)
    return out + [max_batch]


class DecodeGraphs:
    """Captured decode forwards over a fixed KV pool and slot table."""

    def __init__(
        self,
        decoder: Decoder,
        pool: list[tuple[torch.Tensor, torch.Tensor]],
        table: torch.Tensor,
        pad_row: int,
        max_batch: int,
        max_context: int,
    ):
        self.decoder = decoder
        self.pool = pool
        self.table = table
        self.buckets = batch_buckets(max_batch)
        self.max_context = max_context
        self.static = torch.zeros(3, max_batch, dtype=torch.int64, device=decoder.device)
        self.padding = torch.zeros(3, max_batch, dtype=torch.int64, device=decoder.device)
        self.padding[2] = pad_row
        self.graphs: dict[
            tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor | None]
        ] = {}
        self.mempool = torch.cuda.graph_pool_handle()

    def bucket(self, batch: int, context_len: int) -> int | None:
        """The batch bucket a step of this shape replays, or None when it runs eagerly."""
        if context_len > self.max_context or batch > self.buckets[-1]:
            return None
        return next(b for b in self.buckets if b >= batch)

    def run(self, inputs: torch.Tensor, context_len: int) -> torch.Tensor:
        """Logits [B, vocab] for `inputs` [3, B] (ids, positions, rows) on the device."""
        batch = inputs.shape[1]
        padded = self.bucket(batch, context_len)
        assert padded is not None, "caller checks bucket() first"
        lora = self.decoder.lora
        adapters = lora is not None and lora.requests.any_in_use  # else the base model's graph
        key = (padded, context_len, adapters)
        if key not in self.graphs:
            self.graphs[key] = self._capture(padded, context_len, adapters)
        graph, logits, hidden = self.graphs[key]
        self.static[:, :batch].copy_(inputs)
        self._pad(batch, padded)
        graph.replay()
        if hidden is not None:  # the decoder's capture_hidden (an MTP draft): the replay's hidden states
            self.decoder.hidden = hidden[:batch]
        return logits[:batch]

    def clear(self) -> None:
        """Drop every graph (and with them their memory pool)."""
        self.graphs.clear()

    def _pad(self, start: int, stop: int) -> None:
        self.static[:, start:stop].copy_(self.padding[:, : stop - start])

    def _forward(self, batch: int, context_len: int, adapters: bool) -> torch.Tensor:
        s = self.static
        lora = self.decoder.lora.requests.rows if adapters else None
        b = Batch.decode(s[0, :batch], s[1, :batch], s[2, :batch], self.table, context_len, lora)
        return self.decoder.forward(b, self.pool)

    def _capture(
        self, batch: int, context_len: int, adapters: bool
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor | None]:
        self._pad(0, batch)  # warm-up runs write K/V only to the scratch slot
        side = torch.cuda.Stream(self.decoder.device)
        side.wait_stream(torch.cuda.current_stream(self.decoder.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(batch, context_len, adapters)
        torch.cuda.current_stream(self.decoder.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            logits = self._forward(batch, context_len, adapters)
        return graph, logits, self.decoder.hidden if self.decoder.capture_hidden else None
