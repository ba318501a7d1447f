"""Demonstrations (`rollout.env.demonstrations`) against a real engine process and real sandboxes: the
first sample of a training group is the Harbor task's own solution played as tool calls, scored by
its tests; its tokens carry the served model's log-probs (checked against transformers' forward of
the same sequence) with loss mask 1; the group's other samples and held-out episodes are the model's.
Every shipped task's demonstration solves it through the tool path."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
import torch

from miles.agentic.envs.base import make_env
from miles.config.rollout import RolloutConfig
from miles.engine.process import start_engine
from miles.models.tiny import init_tiny
from miles.rollout.client import SGLangClient
from miles.rollout.generate import Generator, PromptEncoder
from miles.rollout.tasks import EVAL_OFFSET, Prompt

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
SHIPPED = Path(__file__).resolve().parents[2] / "tasks"


@pytest.fixture(scope="module")
def coding_model(tmp_path_factory) -> str:
    return str(init_tiny(tmp_path_factory.mktemp("models") / "coding", corpus="coding", vocab_size=512))


@pytest.fixture(scope="module")
def engine(coding_model, tmp_path_factory):
    proc = start_engine(coding_model, device="cpu", log_path=tmp_path_factory.mktemp("demo") / "engine.log")
    yield proc
    proc.stop()


def _samples(model: str, url: str, prompts: list[tuple[int, int]]):
    cfg = RolloutConfig(
        generate_fn="miles.agentic.rollout:env_generate",
        env={"name": "harbor", "options": {"generate": True, "max_turns": 3}, "render_tools": False,
             "max_episode_tokens": 256, "demonstrations": 1},
        max_new_tokens=16,
    )  # fmt: skip

    async def go():
        gen = Generator.from_config([SGLangClient(url)], PromptEncoder(model), lambda s: 0.0, cfg)
        out = []
        for index, sample_index in prompts:
            prompt = Prompt(index, "", None, {"episode": {"seed": 0, "index": index}})
            out.append(await gen.sample(prompt, 0, sample_index))
        return out

    return asyncio.run(go())


def test_the_first_sample_of_a_group_is_the_demonstration(coding_model, engine) -> None:
    from transformers import AutoModelForCausalLM

    demo, model_turn, held_out = _samples(coding_model, engine.url, [(3, 0), (3, 1), (EVAL_OFFSET + 3, 0)])
    assert demo.metadata.get("demonstration") and demo.reward == 1.0
    assert demo.metadata["agent"]["demonstrations"] == 1.0 and "success" not in demo.metadata["agent"]
    assert "<tool_call>bash " in demo.response and "<tool_call>submit</tool_call>" in demo.response
    assert (
        not model_turn.metadata.get("demonstration") and model_turn.metadata["agent"]["demonstrations"] == 0
    )
    assert not held_out.metadata.get("demonstration")

    # the demonstration's turns: mask 1, log-probs of the served weights at those positions
    hf = AutoModelForCausalLM.from_pretrained(coding_model, dtype=torch.float32).eval()
    ids = torch.tensor([demo.prompt_ids + demo.response_ids])
    with torch.no_grad():
        logp = torch.log_softmax(hf(ids).logits[0, :-1].float(), dim=-1)
    n = len(demo.prompt_ids)
    expected = logp[torch.arange(n - 1, ids.shape[1] - 1), ids[0, n:]]
    policy = [i for i, m in enumerate(demo.loss_mask) if m]
    assert len(policy) > 5 and any(m == 0 for m in demo.loss_mask)  # turns and the tool's answer
    got = torch.tensor([demo.rollout_logprobs[i] for i in policy])
    assert torch.allclose(got, expected[policy], atol=1e-4), (got - expected[policy]).abs().max()


def test_every_shipped_task_is_solved_by_its_demonstration() -> None:
    env = make_env("harbor", tasks=str(SHIPPED), max_turns=3)

    async def play(index: int) -> float:
        await env.reset(env.make_task(0, index))
        turns = env.demonstration()
        assert turns, env.task
        for text in turns:
            result = await env.step(text)
            if result.done:
                break
        await env.close()
        return result.reward

    n = len(env.train_paths)
    assert n >= 4
    assert [asyncio.run(play(i)) for i in range(n)] == [1.0] * n
