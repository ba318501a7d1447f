"""Constrained decoding (SGLang's `regex`, `json_schema` and `ebnf` sampling parameters) through
xgrammar, on CPU and GPU alike.

A grammar is compiled once per text (xgrammar's compiler caches compiled grammars) against the
engine's tokenizer, where the request is checked: a grammar that does not compile is a 400 naming
the field. Each request then holds its own `Matcher` (xgrammar's GrammarMatcher): before each
sampling step it fills the token bitmask of what may come next, which sets every other logit to
-inf (miles/engine/penalties.py); after the step it accepts the sampled token. The matcher reports
termination once the grammar is complete and its stop token (EOS) accepted; the request then ends.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from miles.engine.tokenizer import TextCodec

_LOCK = threading.Lock()
_COMPILERS: dict[int, Any] = {}


def _compiler(tokenizer: Any, vocab_size: int, stop_ids: list[int]) -> Any:
    """One xgrammar compiler per (tokenizer, vocabulary size), built on first use (it walks the
    vocabulary once). The engine's codec (miles/engine/tokenizer.py) is handed to xgrammar as the
    Hugging Face fast tokenizer it wraps."""
    import xgrammar as xgr

    key = hash((id(tokenizer), vocab_size))
    with _LOCK:
        if key not in _COMPILERS:
            if isinstance(tokenizer, TextCodec):
                from transformers import PreTrainedTokenizerFast

                tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer._tok)
            info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=vocab_size, stop_token_ids=stop_ids
            )
            _COMPILERS[key] = xgr.GrammarCompiler(info, max_threads=1)
        return _COMPILERS[key]


def compile_grammar(tokenizer: Any, vocab_size: int, stop_ids: list[int], kind: str, text: str) -> Any:
    """The compiled grammar of a `regex`, `json_schema` or `ebnf` text; ValueError naming the field
    when it does not compile."""
    if tokenizer is None:
        raise ValueError(f"sampling_params.{kind} needs the engine's tokenizer; this engine has none")
    comp = _compiler(tokenizer, vocab_size, stop_ids)
    build = {
        "regex": comp.compile_regex,
        "json_schema": comp.compile_json_schema,
        "ebnf": comp.compile_grammar,
    }
    try:
        return build[kind](text)
    except (RuntimeError, ValueError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"sampling_params.{kind} does not compile: {first}") from None


class Matcher:
    """One request's position in its grammar."""

    def __init__(self, compiled: Any, vocab_size: int):
        import xgrammar as xgr

        self._m = xgr.GrammarMatcher(compiled)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def mask(self, z: torch.Tensor) -> torch.Tensor:
        """`z` [vocab] with the tokens the grammar forbids next set to -inf. Token i is allowed when bit
        i % 32 of word i // 32 of xgrammar's bitmask is set; unpacked with torch on z's device, so
        CPU and GPU take the same path."""
        self._m.fill_next_token_bitmask(self._bitmask)
        words = self._bitmask[0].to(z.device, non_blocking=True)
        shifts = torch.arange(32, dtype=torch.int32, device=z.device)
        allowed = ((words[:, None] >> shifts) & 1).reshape(-1)[: z.shape[0]].bool()
        return z.masked_fill(~allowed, float("-inf"))

    def accept(self, token: int) -> bool:
        return self._m.is_terminated() or self._m.accept_token(token)

    def terminated(self) -> bool:
        return self._m.is_terminated()
