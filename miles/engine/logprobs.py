"""SGLang's logprob options in the engine: prompt log-probs from the prefill, and top-k / chosen-id
log-probs at each output position.

Prompt log-probs (`logprob_start_len` = s, prompt of length L): the prefill returns, besides each
request's last-position logits, the logits at prompt positions s .. L-2, which give the log-probs of
tokens s+1 .. L-1; the row of position s itself carries none (SGLang's first `input_token_logprobs`
row is `[None, token, ...]`, whatever s). They are those of the model, log softmax(z), as SGLang's
input log-probs (no temperature: a prompt token was not sampled at any temperature), so scoring a
text with `max_new_tokens: 0` equals a forward of the model over it. The prefix cache never supplies
positions from s on (miles/engine/options.py `match_limit`), so they are computed.

Output positions: the top-k rows and the rows of `token_ids_logprob` come from the distribution the
token was sampled from, log softmax(z' / T) over the shaped logits z' (penalties, bias, grammar),
the same one as `output_token_logprobs` (raw log softmax(z') for greedy requests); top-k rows are
sorted by log-prob, largest first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from miles.engine.options import Row

if TYPE_CHECKING:
    from miles.engine.request import Request

Ask = tuple["Request", int, int]
"""(request, index of its first asked row in the packed prefill tokens, number of rows)."""


def prompt_asks(group: list[Request]) -> list[Ask]:
    """Requests of a prefill group whose prompt log-probs are still to compute, with the packed
    positions of their rows (the order of miles/engine/request.py `prefill_batch`)."""
    asks: list[Ask] = []
    start = 0
    for req in group:
        o = req.opts
        if o is not None and o.input_start is not None and o.input_logprobs is None:
            assert req.kv_len <= o.input_start, "the prefix cache skipped asked prompt positions"
            asks.append((req, start + o.input_start - req.kv_len, len(req.prompt) - 1 - o.input_start))
        start += req.num_tokens - req.kv_len
    return asks


def extra_rows(asks: list[Ask], device: torch.device) -> torch.Tensor:
    """Packed indices of every asked row, in order (appended to the batch's `last_index`)."""
    return torch.cat([torch.arange(first, first + n) for _, first, n in asks]).to(device)


def record_prompt(asks: list[Ask], logits: torch.Tensor) -> None:
    """Store the prompt log-probs of each ask from its rows of `logits` [rows, vocab] (fp32)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    at = 0
    for req, _, n in asks:
        o = req.opts
        rows = logp[at : at + n]
        at += n
        nxt = torch.tensor(req.prompt[o.input_start + 1 :], device=logp.device)
        o.input_logprobs = [None] + rows.gather(1, nxt[:, None])[:, 0].tolist()
        o.input_top = [None] + (_top_rows(rows, o.top_n) if o.top_n else [[] for _ in range(n)])
        o.input_ids = [None] + (
            _id_rows(rows, o.token_ids) if o.token_ids is not None else [[] for _ in range(n)]
        )
        o.input_start = None


@dataclass
class StepRows:
    """The extra rows of one step for the requests that ask for them (`want`: their indices in the
    step's requests): top-k values and ids [W, k] and the token-id log-probs [F], on the device until
    `to_host` queues their copy beside the step's tokens."""

    want: list[int]
    opts: list
    vals: torch.Tensor | None
    idx: torch.Tensor | None
    picked: torch.Tensor | None

    def to_host(self, buffers: RowBuffers) -> StepRows:
        """Queue copies into pinned buffers (no wait): readable once the step's readback event passed."""
        host = buffers.take([t for t in (self.vals, self.idx, self.picked) if t is not None])
        it = iter(host)
        pick = lambda t: None if t is None else next(it)  # noqa: E731
        return StepRows(self.want, self.opts, pick(self.vals), pick(self.idx), pick(self.picked))

    def read(self) -> dict[int, tuple[list[Row], list[Row]]]:
        """Rows by index in the step's requests (reads device tensors, or host copies once landed)."""
        tops: list[list[Row]] = [[] for _ in self.want]
        if self.vals is not None:
            tops = [
                list(zip(v[: o.top_n], t[: o.top_n], strict=True))
                for v, t, o in zip(self.vals.tolist(), self.idx.tolist(), self.opts, strict=True)
            ]
        picked = self.picked.tolist() if self.picked is not None else []
        out, at = {}, 0
        for j, (i, o) in enumerate(zip(self.want, self.opts, strict=True)):
            n = len(o.token_ids or ())
            out[i] = (tops[j], list(zip(picked[at : at + n], o.token_ids or (), strict=True)))
            at += n
        return out


class RowBuffers:
    """Pinned host buffers for the rows of decode steps in flight, used in turn like the token
    buffers of miles/engine/staging.py (a copy to pageable memory would wait for the next step's
    work queued after it); each grows to the largest step seen."""

    def __init__(self, depth: int = 4) -> None:
        self.bufs: list[list[torch.Tensor]] = [[] for _ in range(depth)]
        self.next = 0

    def take(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        k, self.next = self.next, (self.next + 1) % len(self.bufs)
        held = self.bufs[k]
        out = []
        for n, t in enumerate(tensors):
            if n == len(held) or held[n].numel() < t.numel() or held[n].dtype != t.dtype:
                buf = torch.empty(max(t.numel(), 1024), dtype=t.dtype, pin_memory=True)
                held[n : n + 1] = [buf]
            view = held[n][: t.numel()].view(t.shape)
            view.copy_(t, non_blocking=True)
            out.append(view)
        return out


def _on(device: torch.device, values: list, dtype: torch.dtype) -> torch.Tensor:
    """A small host list on `device` without waiting for the work queued there (pinned, non-blocking)."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def step_rows(
    reqs: list[Request], logits: torch.Tensor, temperature: torch.Tensor | None = None
) -> StepRows | None:
    """Top-k and token-id rows of this step for the requests that ask for them (one top-k and one
    gather over all of them), left on the logits' device; None when none asks. `temperature` [B]: the
    step's temperatures already on the device (else built from the requests)."""
    want = [i for i, r in enumerate(reqs) if r.opts is not None and r.opts.wants_rows]
    if not want:
        return None
    dev = logits.device
    if temperature is None:
        temperature = _on(dev, [r.params.temperature for r in reqs], torch.float32)
    if len(want) < len(reqs):
        at = _on(dev, want, torch.long)
        logits, temperature = logits.index_select(0, at), temperature.index_select(0, at)
    scaled = logits.float() / torch.where(temperature > 0, temperature, 1.0)[:, None]
    logp = torch.log_softmax(scaled, dim=-1)
    opts = [reqs[i].opts for i in want]
    k = max(o.top_n for o in opts)
    vals = idx = picked = None
    if k:
        vals, idx = logp.topk(min(k, logp.shape[1]), dim=-1)
    flat = [(j, t) for j, o in enumerate(opts) for t in o.token_ids or ()]
    if flat:
        picked = logp[_on(dev, [j for j, _ in flat], torch.long), _on(dev, [t for _, t in flat], torch.long)]
    return StepRows(want, opts, vals, idx, picked)


def output_rows(reqs: list[Request], logits: torch.Tensor) -> dict[int, tuple[list[Row], list[Row]]]:
    """Top-k and token-id rows of this step, by index in `reqs`, read at once."""
    rows = step_rows(reqs, logits)
    return rows.read() if rows is not None else {}


def _top_rows(logp: torch.Tensor, k: int) -> list[list[Row]]:
    vals, idx = logp.topk(min(k, logp.shape[1]), dim=-1)
    return [list(zip(v, i, strict=True)) for v, i in zip(vals.tolist(), idx.tolist(), strict=True)]


def _id_rows(logp: torch.Tensor, ids: list[int]) -> list[list[Row]]:
    vals = (
        logp[:, torch.tensor(ids, device=logp.device, dtype=torch.long)].tolist() if ids else [[]] * len(logp)
    )
    return [list(zip(v, ids, strict=True)) for v in vals]
