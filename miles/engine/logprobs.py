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


def output_rows(reqs: list[Request], logits: torch.Tensor) -> dict[int, tuple[list[Row], list[Row]]]:
    """Top-k and token-id rows of this step, by index in `reqs`, for requests that ask for them (one
    top-k and one gather over all of them, one readback each)."""
    want = [i for i, r in enumerate(reqs) if r.opts is not None and r.opts.wants_rows]
    if not want:
        return {}
    dev = logits.device
    temps = torch.tensor([reqs[i].params.temperature for i in want], device=dev)
    scaled = logits[torch.tensor(want, device=dev)] / torch.where(temps > 0, temps, 1.0)[:, None]
    logp = torch.log_softmax(scaled.float(), dim=-1)
    opts = [reqs[i].opts for i in want]
    k = max(o.top_n for o in opts)
    tops = [[]] * len(want)
    if k:
        vals, idx = logp.topk(min(k, logp.shape[1]), dim=-1)
        tops = [
            list(zip(v[: o.top_n], t[: o.top_n], strict=True))
            for v, t, o in zip(vals.tolist(), idx.tolist(), opts, strict=True)
        ]
    flat = [(j, t) for j, o in enumerate(opts) for t in o.token_ids or ()]
    picked = logp[[j for j, _ in flat], [t for _, t in flat]].tolist() if flat else []
    out, at = {}, 0
    for j, (i, o) in enumerate(zip(want, opts, strict=True)):
        n = len(o.token_ids or ())
        out[i] = (tops[j], list(zip(picked[at : at + n], o.token_ids or (), strict=True)))
        at += n
    return out


def _top_rows(logp: torch.Tensor, k: int) -> list[list[Row]]:
    vals, idx = logp.topk(min(k, logp.shape[1]), dim=-1)
    return [list(zip(v, i, strict=True)) for v, i in zip(vals.tolist(), idx.tolist(), strict=True)]


def _id_rows(logp: torch.Tensor, ids: list[int]) -> list[list[Row]]:
    vals = (
        logp[:, torch.tensor(ids, device=logp.device, dtype=torch.long)].tolist() if ids else [[]] * len(logp)
    )
    return [list(zip(v, ids, strict=True)) for v in vals]
