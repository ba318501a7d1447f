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
        self.vocab_size = vocab_size

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write what may come next into row `row` of an xgrammar bitmask (int32 [rows, ceil(V / 32)])."""
        self._m.fill_next_token_bitmask(bitmask, row)

    def mask(self, z: torch.Tensor) -> torch.Tensor:
        """`z` [vocab] with the tokens the grammar forbids next set to -inf."""
        return mask_rows([self], z[None, :])[0]

    def accept(self, token: int) -> bool:
        return self._m.is_terminated() or self._m.accept_token(token)

    def terminated(self) -> bool:
        return self._m.is_terminated()


def mask_rows(matchers: list[Matcher], z: torch.Tensor) -> torch.Tensor:
    """Logit rows `z` [G, vocab] with what each row's grammar forbids next set to -inf: the matchers
    fill one host bitmask, which goes to z's device in one copy and is unpacked there with torch
    (token i is allowed when bit i % 32 of word i // 32 is set), so CPU and GPU take the same path."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(matchers), matchers[0].vocab_size)
    for j, m in enumerate(matchers):
        m.fill(bitmask, j)
    words = bitmask.to(z.device)
    shifts = torch.arange(32, dtype=torch.int32, device=z.device)
    allowed = ((words[:, :, None] >> shifts) & 1).reshape(len(matchers), -1)[:, : z.shape[1]].bool()
    return z.masked_fill(~allowed, float("-inf"))
