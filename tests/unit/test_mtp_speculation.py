"""Speculative decoding with the model's own MTP layer (`--speculative-algorithm NEXTN`,
miles/engine/mtp.py) in the embedded engine's scheduler:

- an oracle: a target whose attention and MLP outputs are zero predicts the next token from the
  current one alone (x_{t+1} = f(x_t)); an MTP layer that passes the next token's embedding through
  (eh_proj = [I | 0], zero attention and MLP outputs) predicts f(x_{t+1}) = x_{t+2} exactly, so every
  proposal is kept. Positions, the token one ahead, the chain on the MTP's own hidden state and the
  K/V bookkeeping all have to be right for that;
- greedy output equals the plain engine's with a random MTP layer (which keeps few proposals), for
  dense, Qwen3-MoE (routes recorded for R3 equal the plain engine's) and DeepSeek-V3 targets;
- sampled tokens carry the target's log-probs (transformers' scoring of the same tokens);
- `miles model init-tiny --mtp` writes a layer transformers leaves unloaded, the flags are checked.
"""

from __future__ import annotations

import pytest
import torch
from mtp_oracle import oracle_mtp

from miles.engine.fp8_weights import DEFAULT_FP8_MIN_TOKENS, build_decoder
from miles.engine.model import ModelSpec
from miles.engine.mtp import MtpSpeculator, load_mtp
from miles.engine.sampling import SamplingParams
from miles.engine.scheduler import Request, Scheduler


def _scheduler(path: str, nextn: bool, steps: int = 3, overlap: bool = False) -> Scheduler:
    dec = build_decoder(ModelSpec.from_dir(path), path, "cpu", torch.float32, "none", DEFAULT_FP8_MIN_TOKENS)
    sched = Scheduler(dec, 8, 4096, overlap=overlap)
    if nextn:
        sched.speculator = MtpSpeculator(sched, load_mtp(path, dec, sched.max_total_tokens + 1), steps)
    return sched


def _run(sched: Scheduler, temperature: float, n: int = 20, routes: bool = False) -> list[Request]:
    prompts = [[3, 9, 17, 5], [3, 9, 17, 5, 40], [60, 61], [3, 9, 17, 5]]  # shared prefixes: radix hits
    reqs = [Request(str(i), p, SamplingParams(max_new_tokens=n, temperature=temperature), 100 + i, frozenset())
            for i, p in enumerate(prompts)]  # fmt: skip
    for r in reqs:
        r.return_routed_experts = routes
        sched.submit(r)
    sched.run_until_idle()
    return reqs


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe"])
def test_an_oracle_mtp_layer_keeps_every_proposal(tmp_path, arch):
    """The oracle (tests/mtp_oracle.py) of a dense and of a mixture-of-experts model, whose stacked
    experts' outputs it zeroes too (made large first, so that experts left alone would change the
    tokens): every proposal kept."""
    from safetensors.torch import load_file, save_file

    from miles.models.tiny import init_tiny

    path = init_tiny(tmp_path / "oracle", arch=arch, seed=0, mtp=True)
    for f in path.glob("*.safetensors"):
        tensors = {n: t * 100 if n.endswith("experts.down_proj") else t for n, t in load_file(str(f)).items()}
        save_file(tensors, str(f), metadata={"format": "pt"})
    model = oracle_mtp(path)
    plain = _run(_scheduler(model, False), 0.0)
    spec = _run(_scheduler(model, True), 0.0)
    assert [r.output for r in spec] == [r.output for r in plain]
    proposed = sum(r.spec_draft_token_num for r in spec)
    assert proposed > 0 and sum(r.spec_accept_token_num for r in spec) == proposed
    assert all(r.spec_verify_ct < len(r.output) / 2 for r in spec), "several tokens per verify forward"


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory) -> str:
    from miles.models.tiny import init_tiny

    return str(init_tiny(tmp_path_factory.mktemp("mtp") / "m", seed=0, mtp=True))


def test_greedy_equals_the_plain_engine_with_a_random_mtp_layer(mtp_model):
    plain = _run(_scheduler(mtp_model, False), 0.0)
    spec = _run(_scheduler(mtp_model, True), 0.0)
    for a, b in zip(plain, spec, strict=True):
        assert a.output == b.output
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
    assert all(r.spec_verify_ct > 0 for r in spec)


def test_sampled_tokens_carry_the_targets_logprobs(mtp_model):
    from transformers import AutoModelForCausalLM

    reqs = _run(_scheduler(mtp_model, True), 1.0)
    hf = AutoModelForCausalLM.from_pretrained(mtp_model, dtype=torch.float32).eval()
    for r in reqs:
        assert len(r.output) == 20 and r.spec_verify_ct > 0
        with torch.no_grad():
            logits = hf(torch.tensor([r.prompt + r.output])).logits[0].float()
        want = torch.log_softmax(logits[len(r.prompt) - 1 : -1], -1).gather(
            1, torch.tensor(r.output)[:, None]
        )
        assert torch.allclose(torch.tensor(r.logprobs), want[:, 0], atol=1e-4)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_other_families_keep_greedy_output_and_routes(tmp_path, arch):
    from miles.models.tiny import init_tiny

    model = str(init_tiny(tmp_path / arch, arch=arch, seed=0, mtp=True))
    got = []
    for nextn in (False, True):
        sched = _scheduler(model, nextn)
        sched.decoder.record_routing = True
        got.append(_run(sched, 0.0, 10, routes=True))
    for a, b in zip(*got, strict=True):
        assert a.output == b.output
        assert torch.equal(a.routed_experts, b.routed_experts)
    assert sum(r.spec_verify_ct for r in got[1]) > 0


def test_init_tiny_mtp_layer_is_left_out_by_transformers(mtp_model):
    import json
    from pathlib import Path

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    cfg = json.loads((Path(mtp_model) / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1
    layer = load_file(str(Path(mtp_model) / "mtp.safetensors"))
    pre = f"model.layers.{cfg['num_hidden_layers']}."
    assert {pre + "eh_proj.weight", pre + "enorm.weight", pre + "self_attn.q_proj.weight"} <= set(layer)
    hf = AutoModelForCausalLM.from_pretrained(mtp_model)
    assert len(hf.model.layers) == cfg["num_hidden_layers"]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("short_run", [8, 32])
def test_above_max_batch_steps_decode_plainly_and_keep_the_mtp_history(
    tmp_path, monkeypatch, overlap, short_run
):
    """--speculative-max-batch 1: while four requests decode, no step speculates; once the short ones
    finish, the long one speculates with its MTP history intact (the oracle keeps every proposal). With
    `overlap` the big batch's steps run one ahead of their readback (as on a GPU): the MTP follows them
    from the hidden states kept with each step in flight, a few steps at a time. `short_run` 32: the
    queued steps' MTP forward is decode-shaped."""
    from miles.engine import mtp
    from miles.models.tiny import init_tiny

    monkeypatch.setattr(mtp, "SHORT_RUN", short_run)

    model = oracle_mtp(init_tiny(tmp_path / "oracle", seed=0, mtp=True))
    outs = []
    for nextn in (False, True):
        sched = _scheduler(model, nextn, overlap=overlap)
        if nextn:
            sched.speculator.max_batch = 1
        reqs = [Request(str(i), [3 + i, 9, 17], SamplingParams(max_new_tokens=14 if i else 40, temperature=0.0),
                        i, frozenset()) for i in range(4)]  # fmt: skip
        for r in reqs:
            sched.submit(r)
        sched.run_until_idle()
        outs.append(reqs)
    plain, spec = outs
    assert [r.output for r in spec] == [r.output for r in plain]
    assert all(r.spec_verify_ct == 0 for r in spec[1:]), "batches of 4 > 1 decode plainly"
    long = spec[0]
    assert long.spec_verify_ct > 0 and long.spec_accept_token_num == long.spec_draft_token_num > 0


def test_a_stop_token_among_kept_proposals_ends_the_request_there(tmp_path):
    from miles.models.tiny import init_tiny

    model = oracle_mtp(init_tiny(tmp_path / "oracle", seed=0, mtp=True))
    plain = _run(_scheduler(model, False), 0.0)
    stop = plain[0].output[7]
    got = []
    for nextn in (False, True):
        sched = _scheduler(model, nextn)
        r = Request("s", list(plain[0].prompt), SamplingParams(max_new_tokens=20, temperature=0.0), 7,
                    frozenset({stop}))  # fmt: skip
        sched.submit(r)
        sched.run_until_idle()
        got.append(r)
    assert got[0].output == got[1].output and got[1].output[-1] == stop
    assert got[1].finish["type"] == "stop" and got[1].spec_verify_ct > 0


@pytest.mark.parametrize("overlap", [False, True])
def test_the_gate_alternates_speculation_and_plain_steps_and_keeps_the_history(tmp_path, overlap):
    """With the gate (miles/engine/spec_gate.py) probing and switching every few steps, greedy output
    is the plain engine's, both modes ran, and the oracle MTP layer still keeps every proposal: its
    history follows the plain steps between the speculative ones."""
    from miles.engine.spec_gate import Gate
    from miles.models.tiny import init_tiny

    model = oracle_mtp(init_tiny(tmp_path / "oracle", seed=0, mtp=True))
    plain = _run(_scheduler(model, False), 0.0, n=40)
    sched = _scheduler(model, True, overlap=overlap)
    sched.speculator.gate = Gate(window=2, reprobe=2)
    spec = _run(sched, 0.0, n=40)
    assert [r.output for r in spec] == [r.output for r in plain]
    assert set(sched.speculator.gate.buckets[4].cost) == {"spec", "plain"}, "both modes ran at 4 requests"
    proposed = sum(r.spec_draft_token_num for r in spec)
    assert proposed > 0 and sum(r.spec_accept_token_num for r in spec) == proposed
    assert sched.speculator._plain is None, "every plain step the gate chose was timed to its end"


@pytest.mark.parametrize("short_run", [8, 32])
def test_the_mtp_state_after_queued_plain_steps_equals_one_forward_over_the_history(
    mtp_model, monkeypatch, short_run
):
    """Three requests decode plain steps only (`max_batch` 0); the MTP takes the queued steps in one
    flush. A request's kept MTP output then equals that of an engine whose MTP took the same history in
    one prefill: the flush forwarded the right tokens at the right positions over the right hidden
    states (the oracle layer, which ignores positions and hidden states, cannot show this). `short_run`
    32: that forward decode-shaped."""
    from miles.engine import mtp

    monkeypatch.setattr(mtp, "SHORT_RUN", short_run)
    sched = _scheduler(mtp_model, True)
    sched.speculator.max_batch = 0
    reqs = [Request(str(i), [3 + i, 9, 17, 5], SamplingParams(max_new_tokens=30, temperature=0.0), i, frozenset())
            for i in range(3)]  # fmt: skip
    for r in reqs:
        sched.submit(r)
    sched._drain_inbox()  # what run_until_idle does first: the submitted requests wait for a step
    for _ in range(100):  # prefill, then plain steps
        if len(reqs[1].output) >= 12 or reqs[1].finish is not None:
            break
        sched.step()
    assert len(reqs[1].output) >= 12 and reqs[1].finish is None, reqs[1].finish
    assert sched.speculator.queue, "the plain steps were queued"
    sched.speculator._flush()
    r = reqs[1]
    kept = sched.speculator.state[r]
    assert kept.upto == r.num_tokens - 1  # every position but the newest token's

    fresh = _scheduler(mtp_model, True)
    history = list(r.tokens[: r.num_tokens - 1])
    one = Request("h", history, SamplingParams(max_new_tokens=3, temperature=0.0), 0, frozenset())
    fresh.submit(one)
    fresh._drain_inbox()
    fresh.step()  # the prefill; the MTP extends over it
    assert one.output[0] == r.tokens[-1], "the target's greedy token differs: the comparison needs it equal"
    want = fresh.speculator.state[one]
    assert want.upto == kept.upto
    torch.testing.assert_close(kept.logits, want.logits, atol=1e-4, rtol=1e-4)
