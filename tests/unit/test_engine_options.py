"""Requests with logprob/sampling options inside the scheduler (no HTTP): with the step-ahead
scheduler that CUDA uses (`overlap`, run here on CPU) and without it they get the same tokens,
finishes and log-prob rows (a request asking only for rows stays on the step-ahead path), plain requests beside them get exactly the tokens they get alone, and the count of
running requests with options returns to zero; xgrammar's bitmask unpacked with torch equals
xgrammar's own masking."""

from __future__ import annotations

import pytest
import torch

from miles.engine.grammar import Matcher, compile_grammar
from miles.engine.model import Decoder, ModelSpec, load_weights
from miles.engine.options import build_options
from miles.engine.request import Request
from miles.engine.sampling import SamplingParams
from miles.engine.scheduler import Scheduler
from miles.engine.tokenizer import TextCodec

EOS = frozenset({2})
OPTIONS = [
    {"frequency_penalty": 0.5, "max_new_tokens": 15},
    {"logit_bias": {"33": 3.0}, "max_new_tokens": 12},
    {"min_new_tokens": 5, "max_new_tokens": 9, "logit_bias": {"2": 100}},
    {"regex": "[0-9]{4}", "max_new_tokens": 10},
    {"stop": ["e"], "max_new_tokens": 30},
    {"max_new_tokens": 0},
    {"max_new_tokens": 14},  # log-prob rows only: stays on the step-ahead path, rows read back later
]


def _plain() -> list[Request]:
    return [
        Request(
            rid=f"p{i}",
            prompt=[(i * 7 + j) % 300 + 4 for j in range(8 + i)],
            params=SamplingParams(max_new_tokens=20 + i, temperature=0.8),
            seed=i,
            stop_ids=EOS,
        )
        for i in range(6)
    ]


def _with_options(codec: TextCodec, vocab: int) -> list[Request]:
    out = []
    for i, kw in enumerate(OPTIONS):
        sp = SamplingParams(temperature=0.7, **kw)
        grammar = Matcher(compile_grammar(codec, vocab, [2], *sp.grammar), vocab) if sp.grammar else None
        prompt = [(i * 5 + j) % 300 + 4 for j in range(10)]
        req = Request(rid=f"s{i}", prompt=prompt, params=sp, seed=100 + i, stop_ids=EOS)
        req.opts = build_options(sp, len(prompt), (0, 3, [5, 6]), EOS, EOS, codec.decode, grammar)
        out.append(req)
    return out


def _run(model: str, overlap: bool, options: bool) -> dict[str, tuple]:
    spec = ModelSpec.from_dir(model)
    sched = Scheduler(Decoder(spec, load_weights(model), "cpu", torch.float32), 16, 8192, overlap=overlap)
    plain = _plain()
    extra = _with_options(TextCodec(model), spec.vocab_size) if options else []
    for req in plain:
        sched.submit(req)
    with sched.lock:  # the requests with options join plain ones already decoding
        sched._drain_inbox()
        for _ in range(4):
            sched.step()
    for req in extra:
        sched.submit(req)
    sched.run_until_idle()
    assert sched._special == 0 and sched._rows == 0
    return {r.rid: (r.output, r.finish, _rows(r)) for r in plain + extra}


def _rows(req: Request):
    """The request's output log-prob rows (None for a plain request)."""
    return None if req.opts is None else (req.opts.output_top, req.opts.output_ids)


def _same(a: dict[str, tuple], b: dict[str, tuple]) -> bool:
    """Equal tokens, finishes and row ids; row log-probs within 1e-4 (batches differ in composition)."""

    def flat(rows):
        return [x for part in rows or () for row in part for x in row]

    for rid in a.keys() | b.keys():
        (out_a, fin_a, rows_a), (out_b, fin_b, rows_b) = a[rid], b[rid]
        ra, rb = flat(rows_a), flat(rows_b)
        if out_a != out_b or fin_a != fin_b or [t for _, t in ra] != [t for _, t in rb]:
            return False
        if any(abs(x - y) > 1e-4 for (x, _), (y, _) in zip(ra, rb, strict=True)):
            return False
    return True


def test_options_under_the_step_ahead_scheduler(tiny_model):
    ahead, plain_ahead = _run(tiny_model, True, True), _run(tiny_model, True, False)
    landed = _run(tiny_model, False, True)
    assert _same(ahead, landed)
    assert {rid: v for rid, v in ahead.items() if rid.startswith("p")} == plain_ahead
    finishes = {rid: v[1] for rid, v in ahead.items()}
    assert finishes["s2"] == {"type": "stop", "matched": 2} and len(ahead["s2"][0]) == 6
    assert finishes["s3"] == {"type": "stop", "matched": 2} and len(ahead["s3"][0]) == 5
    assert finishes["s4"] == {"type": "stop", "matched": "e"}
    assert ahead["s5"][0] == [] and finishes["s5"] == {"type": "length", "length": 0}
    for rid, v in ahead.items():
        if rid.startswith("s"):
            top, ids = v[2]
            assert len(top) == len(ids) == len(v[0]) and all(len(r) == 3 for r in top), rid
            assert all([t for _, t in r] == [5, 6] for r in ids), rid
    assert ahead["s6"][1] == {"type": "length", "length": 14}


@pytest.mark.parametrize("regex", ["[0-9]{3}", "[a-z ]+", "(yes|no)"])
def test_bitmask_unpacking_matches_xgrammar(tiny_model, regex):
    import xgrammar as xgr

    codec = TextCodec(tiny_model)
    vocab = ModelSpec.from_dir(tiny_model).vocab_size
    compiled = compile_grammar(codec, vocab, [2], "regex", regex)
    z = torch.randn(vocab, generator=torch.Generator().manual_seed(0))
    ours = Matcher(compiled, vocab).mask(z)
    ref = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    ref.fill_next_token_bitmask(bitmask)
    expected = z.clone()[None]
    xgr.apply_token_bitmask_inplace(expected, bitmask)
    assert torch.equal(ours, expected[0]) and torch.isfinite(ours).sum() < vocab
