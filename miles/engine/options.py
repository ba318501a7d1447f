"""What a request asks beyond the plain path: SGLang's logprob options and the sampling options that
shape logits or stop on text, held per request in `RequestOptions` (None for a plain request).

Plain requests (sampling with temperature/top-p/top-k, stop tokens, output log-probs) carry no
options object and take the scheduler's fast path unchanged: CUDA-graph decode, one step ahead of
the readback. A request with options that act at every step on the host (`per_step`: penalties,
logit bias, min_new_tokens, stop strings, a grammar, max_new_tokens 0) makes the steps it is part
of land at once (no step ahead), so that its logits can be shaped from its recorded tokens before
sampling (miles/engine/penalties.py). Extra log-prob rows of output positions (top log-probs,
token-id log-probs) need no host work before the next step: they are computed on the device from the
step's logits and read back with its tokens, so such requests keep the step-ahead path
(miles/engine/logprobs.py). Prompt log-probs act only at the prefill.

Stopping, as SGLang (schedule_batch.py `update_finish_state`): a stop string (or a `stop_regex`
match) found in the decoded tail of the output wins over a stop token and over the length limit in
the same step; the reply's text is cut before the stop string (kept with `no_stop_trim`; a regex's
`matched` is its pattern, cut only where that text appears literally, as SGLang's detokenizer does),
`output_ids` keep every token. A
finished grammar (xgrammar reports termination after its stop token) ends the request as a stop
token does.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from miles.engine.grammar import Matcher
    from miles.engine.request import Request

REGEX_TAIL_TOKENS = 256
"""stop_regex patterns are searched in the text of this many last output tokens."""
Row = tuple[float, int]
"""(log-prob, token id) of one token at one position."""


@dataclass(eq=False)
class RequestOptions:
    """A request's options and what they have produced so far."""

    input_start: int | None = None
    """First prompt position of the prompt log-probs still to compute (None: none to compute)."""
    logprob_start: int = 0
    """SGLang's logprob_start_len as resolved: input rows cover prompt[logprob_start:]."""
    top_n: int = 0
    token_ids: list[int] | None = None
    input_logprobs: list[float | None] | None = None
    input_top: list[list[Row] | None] | None = None
    input_ids: list[list[Row] | None] | None = None
    output_top: list[list[Row]] = field(default_factory=list)
    output_ids: list[list[Row]] = field(default_factory=list)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    counts: torch.Tensor | None = None
    """[vocab] float counts of each output token (penalties), on the logits' device."""
    bias: tuple[list[int], list[float]] | None = None
    min_new_tokens: int = 0
    min_stop_ids: list[int] = field(default_factory=list)
    """Tokens masked until min_new_tokens are out (stop_token_ids and EOS, as SGLang)."""
    grammar: Matcher | None = None
    stop_strs: tuple[str, ...] = ()
    stop_regex: tuple[str, ...] = ()
    decode: Callable[[list[int]], str] | None = None
    zero_tokens: bool = False
    """max_new_tokens 0: the prefill runs (prompt log-probs, prefix cache), nothing is sampled."""
    grammar_source: tuple[Any, int] | None = None
    """(compiled grammar, vocabulary size): what each of n samples builds its own matcher from."""
    with_text: bool = False
    """return_text_in_logprobs: log-prob rows carry each token's text."""
    after: Request | None = None
    """Admitted only once this request (the prompt's prefill-only request, for n > 1) has finished."""
    per_step: bool = False

    @property
    def shapes_logits(self) -> bool:
        return bool(
            self.frequency_penalty
            or self.presence_penalty
            or self.repetition_penalty != 1.0
            or self.bias
            or self.min_new_tokens
            or self.grammar is not None
        )

    @property
    def wants_rows(self) -> bool:
        return self.top_n > 0 or self.token_ids is not None

    def finish_flags(self) -> None:
        self.per_step = self.shapes_logits or bool(self.stop_strs or self.stop_regex) or self.zero_tokens


def resolve_logprob_start(start: int, prompt_len: int, token_ids: list[int] | None) -> int:
    """SGLang's resolution of logprob_start_len (scheduler.py): -1 means the output only, or the last
    prompt position when token_ids_logprob is given."""
    if start == -1:
        return prompt_len - 1 if token_ids is not None else prompt_len
    return start


def build_options(
    sp: Any,
    prompt_len: int,
    logprob: tuple[int, int, list[int] | None] | None,
    stop_ids: frozenset[int],
    eos_ids: frozenset[int],
    decode: Callable[[list[int]], str] | None,
    grammar: Matcher | None,
    with_text: bool = False,
) -> RequestOptions | None:
    """The options of one request (None when it has none); `logprob` is (logprob_start_len,
    top_logprobs_num, token_ids_logprob) when return_logprob is on."""
    o = RequestOptions(
        frequency_penalty=sp.frequency_penalty,
        presence_penalty=sp.presence_penalty,
        repetition_penalty=sp.repetition_penalty,
        min_new_tokens=sp.min_new_tokens,
        grammar=grammar,
        stop_strs=sp.stop_strs,
        stop_regex=sp.stop_regex_strs,
        decode=decode,
        zero_tokens=sp.max_new_tokens == 0,
        with_text=with_text,
    )
    if sp.logit_bias:
        o.bias = ([int(k) for k in sp.logit_bias], [float(v) for v in sp.logit_bias.values()])
    if sp.min_new_tokens:
        o.min_stop_ids = sorted(set(sp.stop_token_ids or ()) | set(eos_ids))
    wants_input = False
    if logprob is not None:
        start, o.top_n, o.token_ids = logprob
        o.logprob_start = resolve_logprob_start(start, prompt_len, o.token_ids)
        if o.logprob_start <= prompt_len - 2:
            o.input_start, wants_input = o.logprob_start, True
        else:  # at most one row, and SGLang's first row carries no log-prob
            n = prompt_len - o.logprob_start
            o.input_logprobs, o.input_top, o.input_ids = [None] * n, [None] * n, [None] * n
    o.finish_flags()
    return o if o.per_step or o.wants_rows or wants_input or with_text or o.input_logprobs else None


def waits(req: Request) -> bool:
    """Whether the request must stay queued (its prompt's prefill-only request is not done yet)."""
    o = req.opts
    return o is not None and o.after is not None and not o.after.done.done()


def match_limit(req: Request) -> int:
    """How many prompt tokens the prefix cache may supply: positions whose log-probs are asked for
    must be computed by the prefill."""
    limit = req.num_tokens - 1
    o = req.opts
    if o is not None and o.input_start is not None and o.input_logprobs is None:
        limit = min(limit, o.input_start)
    return limit


def after_record(
    reqs: list[Request], before: list[int], rows: dict[int, tuple[list[Row], list[Row]]]
) -> None:
    """After `_record`: extra rows, penalty counts and grammar state of each request that took a token
    this step, and stop strings / grammar termination (`before`: output lengths before the step)."""
    for i, (req, n) in enumerate(zip(reqs, before, strict=True)):
        o = req.opts
        if o is None or len(req.output) == n:
            continue
        tok = req.output[-1]
        if i in rows:
            top, ids = rows[i]
            o.output_top.append(top)
            o.output_ids.append(ids)
        if o.counts is not None:
            o.counts[tok] += 1
        if o.grammar is not None and not o.grammar.accept(tok) and req.finish is None:
            req.finish = {"type": "abort", "message": f"token {tok} does not fit the request's grammar"}
        if (o.stop_strs or o.stop_regex) and (req.finish is None or req.finish["type"] == "length"):
            matched = _stop_match(o, req.output)
            if matched is not None:
                req.finish = {"type": "stop", "matched": matched}
        if req.finish is None and o.grammar is not None and o.grammar.terminated():
            req.finish = {"type": "stop", "matched": tok}


def _stop_match(o: RequestOptions, output: list[int]) -> str | None:
    """The stop string that the newest token completed, if any (the tail decoded is long enough to hold
    the longest stop string even at a quarter character a token), else the first stop_regex pattern
    found in the last `REGEX_TAIL_TOKENS` tokens' text (SGLang reports the pattern as `matched`)."""
    if o.stop_strs:
        width = 4 * max(len(s) for s in o.stop_strs) + 4
        tail = o.decode(output[-width:])
        found = next((s for s in o.stop_strs if s in tail), None)
        if found is not None:
            return found
    if o.stop_regex:
        tail = o.decode(output[-REGEX_TAIL_TOKENS:])
        return next((p for p in o.stop_regex if re.search(p, tail)), None)
    return None


def trim_text(text: str, finish: dict[str, Any] | None, no_stop_trim: bool) -> str:
    """SGLang's detokenizer: the text ends before a matched stop string (or just after it with
    no_stop_trim)."""
    matched = (finish or {}).get("matched")
    if isinstance(matched, str):
        pos = text.find(matched)
        if pos >= 0:
            return text[: pos + len(matched)] if no_stop_trim else text[:pos]
    return text
