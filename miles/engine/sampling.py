"""Per-request sampling parameters (SGLang's names) and the batched, seeded sampler.

Maths: log-probs are those of the temperature-scaled distribution, log softmax(z / T) before
top-k/top-p (raw log softmax(z) for greedy, T = 0), as SGLang reports by default; the trainer divides
its logits by the same T, so the two agree. Sampling draws from softmax(z / T) restricted to the
top-k tokens and to the smallest set of most likely tokens whose mass reaches top_p, using the
Gumbel-max trick: argmax_i (z_i / T + g_i) with g_i = -log(-log u_i). The uniforms u_i are a hash
of (seed, step, token id), so a request's sample depends only on its own seed and position, not on
which other requests share the batch; T = 0 is greedy (argmax z).

Cost: a request with top_p = 1 and top-k off needs no sort: argmax_i (z_i / T + g_i) over the
whole vocabulary, with log softmax(z / T) from a running log-sum-exp, is one pass over its logits
(one fused kernel on CUDA, miles/engine/triton_sampling.py). Only requests that restrict the support
take the sorted path, and only their rows are sorted; which path a request takes depends on its own
parameters alone, so batching never changes its tokens.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

import torch
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _int64(value: int) -> int:
    if not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(f"{value} is outside the int64 range [-2**63, 2**63 - 1]")
    return value


Int64 = Annotated[int, AfterValidator(_int64)]
"""An integer the engine can hold in an int64 tensor (larger ones are a 400, never a scheduler error)."""

# SGLang fields we accept only at their default value (the embedded engine does not implement them).
_UNSUPPORTED_DEFAULTS: dict[str, Any] = {
    "min_p": 0.0,
    "structural_tag": None,
    "custom_params": None,
}
MAX_STOP_COUNT = 32
"""At most this many stop strings (SGLang's limit)."""
MAX_STOP_REGEX_BYTES = 256
"""At most this long a stop_regex pattern (SGLang's limit)."""
MAX_N = 128
"""At most this many parallel samples per prompt (`n`)."""
_GRAMMARS = ("json_schema", "regex", "ebnf")


class SamplingParams(BaseModel):
    """SGLang's `sampling_params` object (same field names and defaults). Every integer is within
    int64 and every float finite, so no value can fail inside the engine thread."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    max_new_tokens: Int64 = Field(128, ge=0)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: Int64 = -1
    stop_token_ids: list[Int64] | None = None
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    sampling_seed: Int64 | None = None
    stream_interval: Int64 | None = None
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: Int64 = 0
    n: Int64 = 1
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    stop: str | list[str] | None = None
    stop_regex: str | list[str] | None = None
    logit_bias: dict[str, float] | None = None
    custom_params: dict[str, Any] | None = None

    def check_supported(self) -> None:
        """Raise ValueError naming a parameter the embedded engine does not implement, or a value out of
        SGLang's range (sglang/srt/sampling/sampling_params.py `verify`)."""
        for name, default in _UNSUPPORTED_DEFAULTS.items():
            value = getattr(self, name)
            if value != default:
                raise ValueError(
                    f"sampling_params.{name}={value!r} is not supported by the embedded engine "
                    f"(leave it at {default!r})"
                )
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"sampling_params.top_k must be -1 (off) or >= 1, got {self.top_k}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"sampling_params.{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(
                f"sampling_params.repetition_penalty must be in (0, 2] (1 = off), got {self.repetition_penalty}"
            )
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"sampling_params.min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], "
                f"got {self.min_new_tokens}"
            )
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"sampling_params.n must be in [1, {MAX_N}], got {self.n}")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > MAX_STOP_COUNT or any(not s for s in stops):
            raise ValueError(
                f"sampling_params.stop must be at most {MAX_STOP_COUNT} non-empty strings, got {self.stop!r}"
            )
        self._check_stop_regex()
        given = [g for g in _GRAMMARS if getattr(self, g)]
        if len(given) > 1:
            raise ValueError(f"sampling_params: give at most one of json_schema, regex, ebnf (got {given})")

    def _check_stop_regex(self) -> None:
        patterns = self.stop_regex_strs
        if len(patterns) > MAX_STOP_COUNT or any(
            not p or len(p.encode()) > MAX_STOP_REGEX_BYTES for p in patterns
        ):
            raise ValueError(
                f"sampling_params.stop_regex must be at most {MAX_STOP_COUNT} non-empty patterns of at most "
                f"{MAX_STOP_REGEX_BYTES} bytes, got {self.stop_regex!r}"
            )
        for p in patterns:
            try:
                re.compile(p)
            except re.error as e:
                raise ValueError(
                    f"sampling_params.stop_regex {p!r} is not a regular expression: {e}"
                ) from None

    @property
    def stop_regex_strs(self) -> tuple[str, ...]:
        return (self.stop_regex,) if isinstance(self.stop_regex, str) else tuple(self.stop_regex or ())

    @property
    def stop_strs(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(field name, grammar text) of the constrained-decoding field given, if any."""
        return next(((g, getattr(self, g)) for g in _GRAMMARS if getattr(self, g)), None)


_MASK32 = 0xFFFFFFFF


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """Murmur3's 32-bit finaliser on int64 tensors holding values in [0, 2^32)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def uniforms(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] floats in (0, 1), a pure function of (seed, step, token id)."""
    s = _fmix32(seeds & _MASK32)
    s = _fmix32((s ^ (steps * 0x9E3779B1)) & _MASK32)
    tok = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    h = _fmix32((s[:, None] ^ ((tok[None, :] * 0x27D4EB2F) & _MASK32)) & _MASK32)
    return ((h >> 8).float() + 0.5) / float(1 << 24)


def _sample_plain(
    logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and log-probs for rows without top-p/top-k: Gumbel-max over the whole vocabulary."""
    if logits.is_cuda:
        from miles.engine.triton_sampling import gumbel_argmax

        return gumbel_argmax(logits, temperature, seeds, steps)
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, 1.0, temperature)[:, None]
    logp = torch.log_softmax(scaled, dim=-1)
    if bool(greedy.all()):
        tokens = logits.argmax(dim=-1)
    else:
        gumbel = -torch.log(-torch.log(uniforms(seeds, steps, logits.shape[1])))
        tokens = torch.where(greedy, logits.argmax(dim=-1), (scaled + gumbel).argmax(dim=-1))
    return tokens, logp.gather(1, tokens[:, None])[:, 0]


def _sample_filtered(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and log-probs for rows with T > 0 and a top-p/top-k restriction (sorted path)."""
    logp = torch.log_softmax(logits / temperature[:, None], dim=-1)
    scaled = logits / temperature.clamp(min=1e-6)[:, None]
    ordered, order = scaled.sort(dim=-1, descending=True)
    probs = torch.softmax(ordered, dim=-1)
    rank = torch.arange(logits.shape[1], device=logits.device)
    keep = (rank[None, :] < top_k[:, None]) & ((probs.cumsum(-1) - probs) < top_p[:, None])
    gumbel = -torch.log(-torch.log(uniforms(seeds, steps, logits.shape[1]).gather(1, order)))
    choice = ordered.masked_fill(~keep, float("-inf")).add(gumbel).argmax(dim=-1)
    tokens = order.gather(1, choice[:, None])[:, 0]
    return tokens, logp.gather(1, tokens[:, None])[:, 0]


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    filtered_rows: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled token ids [B] and their log-probs under softmax(z / T) [B] from fp32 logits [B, V].

    top_k holds V where the request has no top-k limit; temperature 0 means greedy. `filtered_rows`
    (rows with T > 0 and top_p < 1 or a top-k limit) may be given by a caller that knows them, which
    saves reading the parameters back from the device.
    """
    if filtered_rows is None:
        need = (temperature > 0) & ((top_p < 1) | (top_k < logits.shape[1]))
        filtered_rows = need.nonzero()[:, 0].tolist()
    tokens, logps = _sample_plain(logits, temperature, seeds, steps)
    if filtered_rows:
        rows = torch.tensor(filtered_rows, device=logits.device)
        t, lp = _sample_filtered(
            logits[rows], temperature[rows], top_p[rows], top_k[rows], seeds[rows], steps[rows]
        )
        tokens[rows], logps[rows] = t, lp
    return tokens, logps
