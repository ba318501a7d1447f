"""From a checked /generate body to engine requests with their options (miles/engine/options.py):
SGLang's per-prompt logprob fields, the sampling options that need the tokenizer or a grammar, and
`n > 1` parallel samples.

Logprob fields follow io_struct.py's GenerateReqInput: `logprob_start_len` and `top_logprobs_num`
are one value for every prompt or (batch form) one per prompt; `token_ids_logprob` is one list of
ids for every prompt or (batch form) one list per prompt; they act only with `return_logprob`.

`return_routed_experts` (engines started with `--enable-return-routed-experts`, MoE models) marks
every request of the body; `routed_experts_start_len` is the first position with a row.

`n > 1` (the same n for every prompt, as SGLang) gives each prompt n requests, in the reply list
prompt by prompt (the samples of prompt 0, then of prompt 1, ...), with rids `<rid>_<j>`. As
SGLang's tokenizer manager does, a prefill-only request (max_new_tokens 0) computes each prompt's
K/V first; the samples wait for it and then take the prompt from the prefix cache.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

from miles.engine.grammar import Matcher, compile_grammar
from miles.engine.options import RequestOptions, build_options
from miles.engine.request import Request
from miles.engine.sampling import SamplingParams
from miles.engine.validation import BadRequest, GenerateReqInput


def stop_ids(sp: SamplingParams, eos_ids: frozenset[int]) -> frozenset[int]:
    """SGLang's stop tokens: stop_token_ids and EOS, none at all with ignore_eos."""
    return frozenset() if sp.ignore_eos else frozenset(sp.stop_token_ids or ()) | eos_ids


def _per_prompt(value: Any, n: int, batch: bool, name: str) -> list[Any]:
    if isinstance(value, list):
        if not batch:
            raise BadRequest(f"'{name}' is a list but the input is a single prompt")
        if len(value) != n:
            raise BadRequest(f"'{name}' has {len(value)} entries for a batch of {n}")
        return value
    return [value] * n


def _token_ids(value: Any, n: int, batch: bool) -> list[list[int] | None]:
    if not value:
        return [None] * n
    if isinstance(value[0], list):
        return _per_prompt(value, n, batch, "token_ids_logprob")
    return [list(value)] * n


def _check_ids(ids: list[int] | None, vocab: int, label: str) -> None:
    bad = next((t for t in ids or () if not 0 <= t < vocab), None)
    if bad is not None:
        raise BadRequest(f"{label} must hold token ids in [0, {vocab}), got {bad}")


def attach_options(state: Any, body: GenerateReqInput, reqs: list[tuple[Request, bool]]):
    """The engine requests of `body` (one per prompt in `reqs`, as the server built them) with their
    options set and `n` samples each; returns (requests with return_logprob, prefill-only requests
    to submit first)."""
    n = len(reqs)
    batch = isinstance(body.text, list) or bool(body.input_ids) and isinstance(body.input_ids[0], list)
    starts = _per_prompt(body.logprob_start_len, n, batch, "logprob_start_len")
    tops = _per_prompt(body.top_logprobs_num, n, batch, "top_logprobs_num")
    ids = _token_ids(body.token_ids_logprob, n, batch)
    if body.return_text_in_logprobs and state.tokenizer is None:
        raise BadRequest("return_text_in_logprobs needs the engine's tokenizer; this engine has none")
    samples = {r.params.n for r, _ in reqs}
    if len(samples) > 1:
        raise BadRequest(
            f"sampling_params.n must be the same for every prompt of a batch, got {sorted(samples)}"
        )
    _check_routed(state, body)
    loras = _per_prompt(body.lora_path, n, batch, "lora_path")
    bank = state.scheduler.decoder.lora
    for i, ((req, _), name) in enumerate(zip(reqs, loras, strict=True)):
        if name is None:
            continue
        if bank is None:
            raise BadRequest("lora_path needs the engine started with --enable-lora")
        try:
            bank.slot_of(name)
        except ValueError as e:
            raise BadRequest(f"{e}" + (f" (item {i})" if batch else "")) from None
        req.lora = name
    out, warmups = [], []
    for i, (req, lp) in enumerate(reqs):
        at = f"[{i}]" if batch else ""
        logprob = _logprob(req, starts[i], tops[i], ids[i], state, at) if lp else None
        req.opts = _options(state, req, logprob, body.return_text_in_logprobs and lp, at)
        if req.params.n == 1:
            out.append((req, lp))
            continue
        warmups.append(_prefill_only(req, state))
        out += [(_sample(req, j, warmups[-1], state), lp) for j in range(req.params.n)]
    for req, _ in out:
        req.return_routed_experts = body.return_routed_experts
        req.routed_experts_start_len = body.routed_experts_start_len
    return out, warmups


def _check_routed(state: Any, body: GenerateReqInput) -> None:
    """return_routed_experts needs an MoE model and the engine flag; the start is a position."""
    if not body.return_routed_experts:
        return
    decoder = state.scheduler.decoder
    if decoder.spec.moe is None:
        raise BadRequest(
            "return_routed_experts needs a mixture-of-experts model; this engine serves a dense one"
        )
    if not decoder.record_routing:
        raise BadRequest("return_routed_experts needs the engine started with --enable-return-routed-experts")
    if body.routed_experts_start_len < 0:
        raise BadRequest(f"routed_experts_start_len={body.routed_experts_start_len} must be >= 0")


def _logprob(req: Request, start: Any, top: Any, ids: Any, state: Any, at: str) -> tuple[int, int, Any]:
    vocab = state.scheduler.decoder.spec.vocab_size
    start = -1 if start is None else start
    if not -1 <= start <= len(req.prompt):
        raise BadRequest(
            f"logprob_start_len{at}={start} must be -1 (output only) or in [0, {len(req.prompt)}] "
            "(the prompt's length)"
        )
    top = 0 if top is None else top
    if not 0 <= top <= vocab:
        raise BadRequest(f"top_logprobs_num{at}={top} must be in [0, {vocab}] (the vocabulary size)")
    _check_ids(ids, vocab, f"token_ids_logprob{at}")
    return start, top, ids


def _options(state: Any, req: Request, logprob: Any, with_text: bool, at: str) -> RequestOptions | None:
    sp, vocab = req.params, state.scheduler.decoder.spec.vocab_size
    label = f"sampling_params{at}"
    _check_ids(sp.stop_token_ids, vocab, f"{label}.stop_token_ids")
    for key in sp.logit_bias or {}:
        if not key.strip().lstrip("-").isdigit() or not 0 <= int(key) < vocab:
            raise BadRequest(f"{label}.logit_bias keys must be token ids in [0, {vocab}), got {key!r}")
    for name, on in (("stop", sp.stop_strs), ("stop_regex", sp.stop_regex_strs)):
        if on and state.tokenizer is None:
            raise BadRequest(f"{label}.{name} needs the engine's tokenizer; this engine has none")
    grammar = None
    if sp.grammar is not None:
        kind, text = sp.grammar
        try:
            compiled = compile_grammar(state.tokenizer, vocab, sorted(state.eos_token_ids), kind, text)
        except ValueError as e:
            raise BadRequest(str(e).replace("sampling_params.", label + ".", 1)) from None
        grammar = (compiled, vocab)
    decode = None
    if sp.stop_strs or sp.stop_regex_strs:
        skip = sp.skip_special_tokens
        decode = lambda ids: state.tokenizer.decode(ids, skip_special_tokens=skip)  # noqa: E731
    o = build_options(
        sp,
        len(req.prompt),
        logprob,
        req.stop_ids,
        state.eos_token_ids,
        decode,
        Matcher(*grammar) if grammar else None,
        with_text,
    )
    if grammar is not None:
        o.grammar_source = grammar
    return o


def _prefill_only(req: Request, state: Any) -> Request:
    """SGLang's prefix warm-up for parallel samples: the prompt's prefill, nothing sampled."""
    sp = SamplingParams(max_new_tokens=0)
    warm = Request(
        rid=f"{req.rid}_prefill", prompt=req.prompt, params=sp, seed=0, stop_ids=frozenset(), lora=req.lora
    )
    warm.opts = build_options(sp, len(req.prompt), None, frozenset(), state.eos_token_ids, None, None)
    return warm


def _sample(req: Request, j: int, warmup: Request, state: Any) -> Request:
    """The j-th of a prompt's n samples: its own rid, seed, grammar state and results."""
    seed = req.seed + j if req.params.sampling_seed is not None else state.next_seed()
    out = Request(
        rid=f"{req.rid}_{j}",
        prompt=req.prompt,
        params=req.params,
        seed=seed,
        stop_ids=req.stop_ids,
        lora=req.lora,
    )
    o = copy.copy(req.opts) if req.opts is not None else RequestOptions()
    o.output_top, o.output_ids, o.counts = [], [], None
    if o.grammar is not None:
        o.grammar = Matcher(*o.grammar_source)
    o.after = warmup
    out.opts = o
    return out


async def precompile(state: Any, body: GenerateReqInput) -> None:
    """Compile the body's grammars in a worker thread (the first one also imports xgrammar, seconds),
    so that `attach_options`, on the event loop, finds them in xgrammar's cache; a grammar that does
    not compile is reported there, with its field's name."""
    params = body.sampling_params if isinstance(body.sampling_params, list) else [body.sampling_params]
    texts = {
        (kind, p[kind])
        for p in params
        if isinstance(p, dict)
        for kind in ("regex", "json_schema", "ebnf")
        if isinstance(p.get(kind), str) and p[kind]
    }
    if not texts or state.tokenizer is None:
        return
    vocab, eos = state.scheduler.decoder.spec.vocab_size, sorted(state.eos_token_ids)
    for kind, text in texts:
        try:
            await asyncio.to_thread(compile_grammar, state.tokenizer, vocab, eos, kind, text)
        except ValueError:
            pass
