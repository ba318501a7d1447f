"""Speculative decoding with a draft model in the embedded engine (miles/engine/speculative.py): the
acceptance rule reproduces the target's distribution (a fixed-seed statistical check on a small
vocabulary); greedy outputs equal the plain engine's token for token, with a draft of other weights
and with the target as its own draft (which then keeps every proposal); sampled tokens carry the
target's log-probs (transformers' scoring of the same tokens); SGLang's flags are checked."""

from __future__ import annotations

import argparse

import pytest
import torch

from miles.engine import speculative
from miles.engine.fp8_weights import DEFAULT_FP8_MIN_TOKENS, build_decoder
from miles.engine.model import ModelSpec
from miles.engine.sampling import SamplingParams
from miles.engine.scheduler import Request, Scheduler


def test_acceptance_keeps_the_target_distribution():
    gen = torch.Generator().manual_seed(0)
    vocab, k, trials = 6, 2, 20000
    target = torch.softmax(torch.randn(k + 1, vocab, generator=gen) * 1.5, dim=-1)
    draft = torch.softmax(torch.randn(k, vocab, generator=gen) * 1.5, dim=-1)
    first = torch.zeros(vocab)
    first_kept = 0
    for _ in range(trials):
        proposed = [int(torch.multinomial(draft[i], 1, generator=gen)) for i in range(k)]
        tokens, n = speculative.accept(target, draft, proposed, gen)
        first[tokens[0]] += 1
        first_kept += n >= 1
    gap = (first / trials - target[0]).abs().max().item()
    assert gap < 0.015, f"first token's frequencies differ from the target's by {gap:.4f}"
    expected = torch.minimum(target[0], draft[0]).sum().item()  # P(d1 kept) = sum_x min(p(x), q(x))
    assert abs(first_kept / trials - expected) < 0.015
    tokens, n = speculative.accept(target[:1].repeat(k + 1, 1), target[:1].repeat(k, 1), [1, 2], gen)
    assert n == k and len(tokens) == k + 1, "a draft equal to the target keeps every proposal"


def _scheduler(path: str, draft: str | None = None, steps: int = 3, overlap: bool = False) -> Scheduler:
    def decoder(p: str):
        return build_decoder(ModelSpec.from_dir(p), p, "cpu", torch.float32, "none", DEFAULT_FP8_MIN_TOKENS)

    sched = Scheduler(decoder(path), 8, 4096, overlap=overlap)
    if draft is not None:
        sched.speculator = speculative.Speculator(sched, decoder(draft), steps)
    return sched


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "deepseek_v4"])
def test_other_families_keep_greedy_output(tmp_path, arch):
    """Mixture-of-experts, latent-attention and DeepSeek-V4 targets (each its own draft, then another
    model of its family) give the plain engine's greedy tokens."""
    from miles.models.tiny import init_tiny

    target = str(init_tiny(tmp_path / "t", arch=arch, seed=0))
    other = str(init_tiny(tmp_path / "d", arch=arch, seed=1))
    plain = [r.output for r in _run(_scheduler(target), 0.0, 10)]
    own = _run(_scheduler(target, target), 0.0, 10)
    assert [r.output for r in own] == plain
    assert sum(r.spec_accept_token_num for r in own) == sum(r.spec_draft_token_num for r in own) > 0
    assert [r.output for r in _run(_scheduler(target, other), 0.0, 10)] == plain


def _run(sched: Scheduler, temperature: float, n: int = 24) -> list[Request]:
    reqs = [
        Request(str(i), [3 + i, 9, 17 + 2 * i, 5], SamplingParams(max_new_tokens=n, temperature=temperature),
                100 + i, frozenset())
        for i in range(4)
    ]  # fmt: skip
    for r in reqs:
        sched.submit(r)
    sched.run_until_idle()
    return reqs


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[str, str]:
    from miles.models.tiny import init_tiny

    root = tmp_path_factory.mktemp("spec")
    return str(init_tiny(root / "target", seed=0)), str(init_tiny(root / "draft", seed=1))


@pytest.mark.parametrize("overlap", [False, True])
def test_greedy_equals_the_plain_engine(models, overlap):
    target, draft = models
    plain = _run(_scheduler(target), 0.0)
    for name, model in (("other weights", draft), ("the target itself", target)):
        spec = _run(_scheduler(target, model, overlap=overlap), 0.0)
        for a, b in zip(plain, spec, strict=True):
            assert a.output == b.output, name
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5), name
        proposed = sum(r.spec_draft_token_num for r in spec)
        kept = sum(r.spec_accept_token_num for r in spec)
        assert proposed > 0 and all(r.spec_verify_ct > 0 for r in spec)
        if model == target:
            assert kept == proposed, "the target as its own draft: every proposal is kept"
        else:
            assert kept < proposed, "another model's proposals are not all the target's choices"


def test_sampled_tokens_carry_the_targets_logprobs(models):
    from transformers import AutoModelForCausalLM

    target, draft = models
    reqs = _run(_scheduler(target, draft), 1.0)
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    for r in reqs:
        assert len(r.output) == 24 and r.spec_verify_ct < 24, "several tokens per verify forward"
        with torch.no_grad():
            logits = hf(torch.tensor([r.prompt + r.output])).logits[0].float()
        logp = torch.log_softmax(logits[len(r.prompt) - 1 : -1], dim=-1)
        want = logp.gather(1, torch.tensor(r.output)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(r.logprobs), want, atol=1e-4)


def test_flags_are_sglangs_and_checked():
    p = argparse.ArgumentParser()
    speculative.add_args(p)
    ok = p.parse_args(["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "d",
                       "--speculative-num-steps", "4", "--speculative-num-draft-tokens", "5"])  # fmt: skip
    assert speculative.problem(ok) is None
    for argv, words in [
        (["--speculative-algorithm", "EAGLE"], "use NEXTN"),
        (["--speculative-algorithm", "STANDALONE"], "--speculative-draft-model-path"),
        (["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "d",
          "--speculative-num-draft-tokens", "9"], "num-steps + 1"),
    ]:  # fmt: skip
        assert words in speculative.problem(p.parse_args(argv))


def test_stop_tokens_and_routes_as_the_plain_engine(models, tmp_path):
    """A stop token met among the kept proposals ends the request there, as the plain engine ends it;
    a mixture-of-experts target's recorded routes (R3) are the target's own for every kept token."""
    target, draft = models
    plain = _run(_scheduler(target), 0.0)
    stop = plain[0].output[5]  # a token the greedy output meets early
    reqs = []
    for sched in (_scheduler(target), _scheduler(target, draft)):
        r = Request("s", list(plain[0].prompt), SamplingParams(max_new_tokens=24, temperature=0.0), 7,
                    frozenset({stop}))  # fmt: skip
        sched.submit(r)
        sched.run_until_idle()
        reqs.append(r)
    assert reqs[0].output == reqs[1].output and reqs[1].output[-1] == stop
    assert reqs[1].finish["type"] == "stop"

    from miles.models.tiny import init_tiny

    moe = str(init_tiny(tmp_path / "moe", arch="qwen3_moe", seed=0))
    routes = []
    for with_draft in (False, True):
        sched = _scheduler(moe, moe if with_draft else None)
        sched.decoder.record_routing = True
        r = Request("r", [3, 9, 17, 5], SamplingParams(max_new_tokens=12, temperature=0.0), 7, frozenset())
        r.return_routed_experts = True
        sched.submit(r)
        sched.run_until_idle()
        routes.append((r.output, r.routed_experts))
    assert routes[0][0] == routes[1][0]
    assert torch.equal(routes[0][1], routes[1][1])


def test_recipe_keys_render_sglangs_flags_for_both_engines(tmp_path):
    from miles.config import ConfigError, resolve
    from miles.rollout.engine_argv import engine_argv
    from miles.rollout.sglang import sglang_server_command

    base = {"run": {"runs_root": str(tmp_path)}, "model": {"path": str(tmp_path / "m")}}
    spec = {"draft_model_path": str(tmp_path / "d"), "num_steps": 4}
    flags = ["--speculative-algorithm", "STANDALONE", "--speculative-num-steps", "4",
             "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "5",
             "--speculative-draft-model-path", str(tmp_path / "d")]  # fmt: skip
    embedded = engine_argv(resolve(base | {"engine": {"speculative": spec}}))
    assert " ".join(flags) in " ".join(embedded)
    server = sglang_server_command(resolve(base | {"engine": {"kind": "sglang", "speculative": spec}}),
                                   host="127.0.0.1", port=1)  # fmt: skip
    assert " ".join(flags) in " ".join(server)
    nextn = {"kind": "sglang", "speculative": {"algorithm": "NEXTN", "num_steps": 2}}
    assert "--speculative-algorithm NEXTN" in " ".join(sglang_server_command(resolve(base | {"engine": nextn}),
                                                                              host="127.0.0.1", port=1))  # fmt: skip
    mtp = base | {"model": {"path": str(tmp_path / "m"), "tiny": {"mtp": True}}}
    embedded_nextn = engine_argv(
        resolve(mtp | {"engine": {"speculative": {"algorithm": "NEXTN", "num_steps": 2}}})
    )
    assert "--speculative-algorithm NEXTN --speculative-num-steps 2" in " ".join(embedded_nextn)
    assert "--no-speculative-adaptive" not in embedded  # the gate is on by default
    fixed = engine_argv(resolve(base | {"engine": {"speculative": spec | {"adaptive": False}}}))
    assert "--no-speculative-adaptive" in fixed
    server = sglang_server_command(resolve(base | {"engine": {"kind": "sglang", "speculative": spec | {"adaptive": False}}}),
                                   host="127.0.0.1", port=1)  # fmt: skip
    assert not [a for a in server if "adaptive" in a or "max-batch" in a], "the embedded engine's own flags"
    for engine, key in [({"speculative": {"algorithm": "EAGLE3"}}, "engine.kind=sglang"),
                        ({"speculative": {"algorithm": "NEXTN"}}, "model.tiny.mtp=true"),
                        ({"speculative": {}}, "draft_model_path")]:  # fmt: skip
        with pytest.raises(ConfigError, match=key):
            resolve(base | {"engine": engine})


def test_a_request_past_the_draft_cache_decodes_as_usual(models):
    """The draft's cache holds a run of positions per row (here 256 + k + 1): a request growing past
    it goes on without speculation, its greedy tokens still the plain engine's."""
    target, draft = models
    prompt = [3 + (7 * i) % 90 for i in range(250)]
    outs = []
    for sched in (Scheduler(_scheduler(target).decoder, 8, 2048, overlap=False), _scheduler(target, draft)):
        if sched.speculator is not None:
            sched = Scheduler(sched.decoder, 8, 2048, overlap=False)
            sched.speculator = speculative.Speculator(sched, _scheduler(draft).decoder, 3)
            assert sched.speculator.cache.stride == 256 + 3 + 1
        r = Request("long", prompt, SamplingParams(max_new_tokens=16, temperature=0.0), 1, frozenset())
        sched.submit(r)
        sched.run_until_idle()
        outs.append(r)
    assert outs[0].output == outs[1].output and len(outs[1].output) == 16
    assert 0 < outs[1].spec_verify_ct < 16, "speculation until the run is full, then plain decoding"


@pytest.mark.parametrize("overlap", [False, True])
def test_the_gate_switches_modes_and_outputs_stay_the_plain_engines(models, overlap):
    """STANDALONE under the gate (probes of two steps, another probe every two): the draft's cache
    catches up after plain steps, and greedy output and log-probs stay the plain engine's. With
    `overlap` the plain steps run one ahead of their readback, as on a GPU."""
    from miles.engine.spec_gate import Gate

    target, draft = models
    plain = _run(_scheduler(target), 0.0)
    sched = _scheduler(target, draft, overlap=overlap)
    sched.speculator.gate = Gate(window=2, reprobe=2)
    spec = _run(sched, 0.0)
    for a, b in zip(plain, spec, strict=True):
        assert a.output == b.output
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
    assert set(sched.speculator.gate.buckets[4].cost) == {"spec", "plain"}, "both modes ran at 4 requests"
    assert all(r.spec_verify_ct > 0 for r in spec)


def test_greedy_and_sampled_requests_speculate_in_one_batch(models):
    """One verify forward for greedy and sampled requests together (the greedy ones read back as argmax
    and log-prob, the sampled ones as rows): greedy tokens are the plain engine's, and every token
    carries the target's log-prob (transformers' forward)."""
    from transformers import AutoModelForCausalLM

    target, draft = models
    sched = _scheduler(target, draft)
    temps = [0.0, 1.0, 0.0, 0.7]
    reqs = [Request(str(i), [3 + i, 9, 17 + 2 * i, 5], SamplingParams(max_new_tokens=16, temperature=t),
                    100 + i, frozenset()) for i, t in enumerate(temps)]  # fmt: skip
    for r in reqs:
        sched.submit(r)
    sched.run_until_idle()
    plain = _run(_scheduler(target), 0.0, n=16)
    assert reqs[0].output == plain[0].output and reqs[2].output == plain[2].output
    assert all(r.spec_verify_ct > 0 for r in reqs)
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    for r, t in zip(reqs, temps, strict=True):
        with torch.no_grad():
            logits = hf(torch.tensor([r.prompt + r.output])).logits[0].float()
        logp = torch.log_softmax(logits[len(r.prompt) - 1 : -1] / (t or 1.0), dim=-1)
        want = logp.gather(1, torch.tensor(r.output)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(r.logprobs), want, atol=1e-4), t


@pytest.mark.parametrize(("max_batch", "rows"), [(None, 8 * 4), (4, 4 * 4), (1, 8)])
def test_captured_steps_widen_to_a_verify_of_the_largest_speculating_batch(models, max_batch, rows):
    """A verify of B requests is a decode-shaped step of B (k + 1) rows: the captured steps reach the
    rows of the largest batch that may speculate (k = 3 here; never narrower than the scheduler's own)."""
    target, draft = models
    sched = _scheduler(target, draft)
    sched.speculator.max_batch = max_batch
    speculative.fit_verify_graphs(sched)
    assert sched.graph_max_bs == 8 and sched.graph_rows == rows
