"""The parts of SGLang's /generate reply that depend on a request's options: the text (stop trimming,
as sglang/srt/managers/detokenizer_manager.py) and the logprob fields of `meta_info` (as
tokenizer_manager.py `add_logprob_to_meta_info`), and `routed_experts` (as the tokenizer manager
encodes it: base64 of the int32 C-order bytes of [rows, num_hidden_layers, top_k], sent at finish).

Rows are `[logprob, token_id, text]` with text null unless `return_text_in_logprobs`; the first row
of `input_token_logprobs` has a null log-prob, and the first entry of `input_top_logprobs` /
`input_token_ids_logprobs` is null (no context predicts it). `output_top_logprobs` and
`output_token_ids_logprobs` hold one list of rows per output token. Lists with one entry per output
token are cut to `len(req.output)`, so a reply built while the request runs (streaming) is
consistent.
"""

from __future__ import annotations

import base64
from typing import Any

from miles.engine.options import Row, trim_text
from miles.engine.request import Request


def reply_text(tokenizer: Any, req: Request) -> str:
    """The reply's text: a matched stop token is not decoded and a matched stop string is cut, unless
    no_stop_trim."""
    if tokenizer is None:
        return ""
    sp = req.params
    ids = req.output
    if isinstance((req.finish or {}).get("matched"), int) and not sp.no_stop_trim and ids:
        ids = ids[:-1]
    text = tokenizer.decode(ids, skip_special_tokens=sp.skip_special_tokens)
    return trim_text(text, req.finish, sp.no_stop_trim)


def logprob_meta(tokenizer: Any, req: Request) -> dict[str, Any]:
    """meta_info's logprob fields for a request with return_logprob."""
    o = req.opts
    n = len(req.output)
    texts = _texts(tokenizer) if o is not None and o.with_text else None
    start = o.logprob_start if o is not None else len(req.prompt)
    in_lps = (o.input_logprobs if o is not None else None) or []
    meta: dict[str, Any] = {
        "input_token_logprobs": _rows(list(zip(in_lps, req.prompt[start:], strict=False)), texts),
        "output_token_logprobs": _rows(list(zip(req.logprobs[:n], req.output, strict=False)), texts),
    }
    if o is None:
        return meta
    if o.wants_rows and len(o.output_top) < n:  # read mid-append by a stream: the caller reads again
        raise ValueError("output log-prob rows are one token behind")
    if o.top_n > 0:
        meta["input_top_logprobs"] = [None if r is None else _rows(r, texts) for r in o.input_top or []]
        meta["output_top_logprobs"] = [_rows(r, texts) for r in o.output_top[:n]]
    if o.token_ids is not None:
        meta["input_token_ids_logprobs"] = [None if r is None else _rows(r, texts) for r in o.input_ids or []]
        meta["output_token_ids_logprobs"] = [_rows(r, texts) for r in o.output_ids[:n]]
    return meta


def routed_meta(req: Request) -> dict[str, Any]:
    """meta_info's `routed_experts` once the request has finished with return_routed_experts (rows of
    positions routed_experts_start_len .. prompt + completion - 2; the last token was never forwarded)."""
    if req.routed_experts is None:
        return {}
    return {"routed_experts": base64.b64encode(req.routed_experts.contiguous().numpy().tobytes()).decode()}


def _texts(tokenizer: Any):
    cache: dict[int, str] = {}

    def text(token: int) -> str:
        if token not in cache:
            cache[token] = tokenizer.decode([token], skip_special_tokens=False)
        return cache[token]

    return text


def _rows(rows: list[Row], texts) -> list[tuple[float | None, int, str | None]]:
    if texts is None:
        return [(lp, tok, None) for lp, tok in rows]
    return [(lp, tok, texts(tok)) for lp, tok in rows]
