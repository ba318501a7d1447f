"""Distillation teachers against a real engine process: scoring the student's samples with the student's
own model gives back the rollout log-probs, the per-sample teacher choice is checked, and a teacher with
another tokenizer is refused."""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from miles.config import ConfigError
from miles.engine.process import start_engine
from miles.models.tiny import init_tiny
from miles.rollout.client import SGLangClient
from miles.rollout.teacher import Teacher, check_tokenizer, tokenizer_difference
from miles.sample import Sample


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    proc = start_engine(tiny_model, device="cpu", log_path=tmp_path_factory.mktemp("teacher") / "engine.log")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def other_tokenizer_model(tmp_path_factory) -> str:
    return str(init_tiny(tmp_path_factory.mktemp("models") / "other", seed=7))


async def _samples(client: SGLangClient, n: int = 4) -> list[Sample]:
    out = []
    for i in range(n):
        prompt = [10 + i, 20, 30, 40 + i]
        r = await client.generate(
            prompt, {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True, "sampling_seed": i}
        )
        out.append(Sample(0, i, prompt, r.output_ids, [1] * len(r.output_ids), r.logprobs))
    return out


def test_scoring_with_the_student_model_gives_the_rollout_logprobs(engine):
    async def go():
        client = SGLangClient(engine.url)
        samples = await _samples(client)
        teacher = Teacher([client])
        await teacher.score(samples)
        busy = teacher.take_busy_s()
        await client.aclose()
        return samples, busy

    samples, busy = asyncio.run(go())
    assert busy > 0
    for s in samples:
        assert len(s.teacher_logprobs) == s.response_length == 6
        worst = max(abs(a - b) for a, b in zip(s.teacher_logprobs, s.rollout_logprobs, strict=True))
        assert worst < 1e-4, f"prefill-scored vs decode log-probs differ by {worst}"


def test_per_sample_teacher_choice_names_a_missing_teacher(engine):
    async def go():
        client = SGLangClient(engine.url)
        samples = await _samples(client, 2)
        samples[1].metadata["teacher"] = 3
        try:
            await Teacher([client], key="teacher").score(samples)
        finally:
            await client.aclose()

    with pytest.raises(ValueError, match=r"teacher=3 \(train.distill.teacher_key\) names no teacher"):
        asyncio.run(go())


def test_a_teacher_with_another_tokenizer_is_refused(engine, tiny_model, other_tokenizer_model):
    ours = AutoTokenizer.from_pretrained(tiny_model)
    theirs = AutoTokenizer.from_pretrained(other_tokenizer_model)

    async def check(tok):
        client = SGLangClient(engine.url)
        try:
            await check_tokenizer(client, lambda text: tok.encode(text, add_special_tokens=False))
        finally:
            await client.aclose()

    asyncio.run(check(ours))  # the engine serves tiny_model: same tokenizer, accepted
    with pytest.raises(ConfigError, match="same tokenizer"):
        asyncio.run(check(theirs))
    assert tokenizer_difference(tiny_model, tiny_model) is None
    assert "tokenises" in tokenizer_difference(tiny_model, other_tokenizer_model)


def test_topk_scoring_returns_the_engines_own_distribution(engine, tiny_model):
    """With top_k the teacher's rows are the k likeliest tokens at each response position, in
    order, and their log-probs equal the model's full softmax there (HF forward in fp32)."""
    import torch
    from transformers import AutoModelForCausalLM

    async def go():
        client = SGLangClient(engine.url)
        samples = await _samples(client, n=2)
        await Teacher([client], top_k=5).score(samples)
        await client.aclose()
        return samples

    samples = asyncio.run(go())
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    for s in samples:
        ids, logp = s.teacher_topk
        assert ids.shape == logp.shape == (s.response_length, 5) and not s.teacher_logprobs
        with torch.no_grad():
            full = model(torch.tensor([s.tokens])).logits[0].log_softmax(-1)
        rows = full[len(s.prompt_ids) - 1 : len(s.tokens) - 1]
        want = rows.topk(5, dim=-1)
        assert (torch.as_tensor(ids) == want.indices).all()
        assert torch.allclose(torch.as_tensor(logp), want.values, atol=1e-4)
