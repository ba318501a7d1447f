"""Loss masks of multi-turn samples, end to end: one hand-checked `lookup` episode built by the
token-level generate function, and tokens with mask 0 leaving no trace in the loss, its gradient,
the train/rollout mismatch metric and the buffer's staleness.

The engine is a scripted client (it plays the model's choices, so the episode can be checked by
hand); the generator, the environment, the chat template and tokenizer of the tiny model, the
packing, the objective and the tiny model itself are the real ones.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from miles.config.rollout import RolloutConfig
from miles.config.train import LossConfig
from miles.rollout.buffer import group_staleness
from miles.rollout.client import GenerateResult
from miles.rollout.generate import Generator, PromptEncoder
from miles.rollout.tasks import Prompt
from miles.sample import Sample, Status
from miles.train.batching import pack, response_logprobs
from miles.train.losses import token_weights
from miles.train.objective import TokenBatch, policy_objective

SEED, INDEX = 0, 5  # lookup task (seed 0, index 5): key 9, table[9] = 9; table[4] = 5


class ScriptedEngine:
    """Answers each /generate with the next scripted turn: (tokens, log-probs, weight version)."""

    def __init__(self, turns: list[tuple[list[int], list[float], int]]) -> None:
        self.turns, self.prompts = list(turns), []

    async def generate(self, input_ids: list[int], params: dict, **options: object) -> GenerateResult:
        self.prompts.append(list(input_ids))
        ids, logprobs, version = self.turns.pop(0)
        finish = "stop" if ids[-1] == 2 else "length"
        reply = {
            "output_ids": ids,
            "meta_info": {
                "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, ids, strict=True)],
                "finish_reason": {"type": finish},
                "weight_version": str(version),
            },
        }
        return GenerateResult.from_reply(reply)


@pytest.fixture(scope="module")
def encoder(tmp_path_factory: pytest.TempPathFactory) -> PromptEncoder:
    from miles.models.tiny import init_tiny

    return PromptEncoder(str(init_tiny(tmp_path_factory.mktemp("tiny") / "model")))


def _ids(encoder: PromptEncoder, tokens: list[str]) -> list[int]:
    return encoder.tokenizer.convert_tokens_to_ids(tokens)


def _episode(encoder: PromptEncoder, turns: list[tuple[list[int], list[float], int]]) -> Sample:
    cfg = RolloutConfig(
        generate_fn="miles.agentic.rollout:env_generate",
        env={"name": "miles.agentic.tasks:LookupEnv", "render_tools": False},
        max_new_tokens=2,
    )
    engine = ScriptedEngine(turns)
    gen = Generator.from_config([engine], encoder, lambda s: 0.0, cfg)  # type: ignore[list-item]
    prompt = Prompt(INDEX, "", None, {"episode": {"seed": SEED, "index": INDEX}})
    s = asyncio.run(gen.sample(prompt, 0, 0))
    # every turn was asked on exactly the tokens so far (nothing re-tokenised in between)
    assert engine.prompts[-1] == s.prompt_ids + s.response_ids[: -len(turns[-1][0])]
    return s


def test_hand_checked_episode_masks(encoder: PromptEncoder) -> None:
    """A wrong call (key 4, no end token, version 3), its tool answer, then the copied answer with
    the end token under version 4 (an in-place update between the turns)."""
    four, five, eos = _ids(encoder, ["4", "5", "<|im_end|>"])
    s = _episode(encoder, [([four], [-0.5], 3), ([five, eos], [-0.25, -0.125], 4)])
    assert s.prompt_ids == _ids(
        encoder, ["<|im_start|>", "user", "Ċ", "value", "Ġ", "9", "<|im_end|>", "Ċ"]
    ) + _ids(encoder, ["<|im_start|>", "as", "sistant", "Ċ"])
    tool_turn = ["<|im_end|>", "Ċ", "<|im_start|>", "t", "o", "o", "l", "Ċ", "5", "<|im_end|>", "Ċ"]
    header = ["<|im_start|>", "as", "sistant", "Ċ"]
    assert s.response_ids == [four, *_ids(encoder, tool_turn + header), five, eos]
    assert s.loss_mask == [1] + [0] * 15 + [1, 1]
    assert s.rollout_logprobs == [-0.5] + [0.0] * 15 + [-0.25, -0.125]
    assert s.weight_versions == [3] * 16 + [4, 4]
    # called the wrong key (4 instead of 9) and copied its value: partial credit for a parsed call
    # and for the copy, no success
    assert s.reward == pytest.approx(0.4)
    assert s.metadata["agent"]["turns"] == 2
    assert s.metadata["agent"]["tool_calls"] == 1 and s.metadata["agent"]["tool_errors"] == 0
    assert s.metadata["agent"]["success"] == 0.0


def test_hand_checked_episode_with_tool_error(encoder: PromptEncoder) -> None:
    """A call turn that ends itself and holds no key earns `error`, the retry succeeds, the answer
    is right: mask 1 exactly on the three model turns; the closing token is never added twice."""
    a, eos, nine = _ids(encoder, ["a", "<|im_end|>", "9"])
    s = _episode(encoder, [([a, eos], [-1.0, -2.0], 1), ([nine], [-0.5], 1), ([nine, eos], [-0.1, -0.2], 1)])
    error_turn = ["Ċ", "<|im_start|>", "t", "o", "o", "l", "Ċ", "er", "r", "or", "<|im_end|>", "Ċ"]
    value_turn = ["<|im_end|>", "Ċ", "<|im_start|>", "t", "o", "o", "l", "Ċ", "9", "<|im_end|>", "Ċ"]
    header = _ids(encoder, ["<|im_start|>", "as", "sistant", "Ċ"])
    expected = [a, eos, *_ids(encoder, error_turn), *header, nine, *_ids(encoder, value_turn), *header]
    assert s.response_ids == [*expected, nine, eos]
    assert s.loss_mask == [1, 1] + [0] * 16 + [1] + [0] * 15 + [1, 1]
    assert s.reward == 1.0 and s.metadata["agent"]["success"] == 1.0
    assert s.metadata["agent"]["tool_errors"] == 1 and s.metadata["agent"]["tool_calls"] == 2
    assert s.metadata["agent"]["turns"] == 3


def _multi_turn_samples(encoder: PromptEncoder) -> list[Sample]:
    four, five, eos, nine = _ids(encoder, ["4", "5", "<|im_end|>", "9"])
    wrong = _episode(encoder, [([four], [-0.5], 3), ([five, eos], [-0.25, -0.125], 4)])
    right = _episode(encoder, [([nine], [-0.7], 3), ([nine, eos], [-0.3, -0.2], 3)])
    right.group_id = wrong.group_id = 0
    right.index = 1
    return [wrong, right]


def _objective(model: torch.nn.Module, samples: list[Sample], noise: float) -> tuple[torch.Tensor, ...]:
    """Loss (all terms on: TIS, KL to a reference, entropy bonus) and the logits' gradient of the
    packed samples; `noise` is added to the rollout and reference log-probs of mask-0 tokens."""
    packed = pack(samples, [0, 1])
    logits = model(input_ids=packed.input_ids, position_ids=packed.position_ids).logits[0]
    logits.retain_grad()
    logp, entropy = response_logprobs(logits, packed, 1.0, with_entropy=True)
    off = packed.mask == 0
    rollout = packed.rollout_logp + noise * off
    ref = logp.detach() - 0.1 + noise * off
    n = int(packed.mask.sum())
    tb = TokenBatch(
        logp=logp,
        old_logp=rollout,
        rollout_logp=rollout,
        advantages=torch.tensor([-1.0, 1.0]).repeat_interleave(torch.bincount(packed.seq_index)),
        mask=packed.mask,
        weights=token_weights(packed.mask, packed.seq_index, 2, "token", n, 2),
        seq_index=packed.seq_index,
        n_seqs=2,
        ref_logp=ref,
        entropy=entropy,
    )
    cfg = LossConfig(kl_coef=0.1, entropy_coef=0.01, tis="truncate")
    loss, _ = policy_objective(tb, cfg)
    loss.backward()
    return loss.detach(), logits.grad[packed.logit_index].clone(), packed


def test_mask_zero_tokens_add_nothing_to_loss_or_gradient(encoder: PromptEncoder) -> None:
    from transformers import AutoModelForCausalLM

    samples = _multi_turn_samples(encoder)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(encoder.tokenizer.name_or_path)
    loss, grad, packed = _objective(model, samples, 0.0)
    model.zero_grad()
    loss_noisy, grad_noisy, _ = _objective(model, samples, 30.0)
    off = packed.mask == 0
    assert off.sum() == 30 and (~off).sum() == 6
    # the logit rows that predict mask-0 tokens get no gradient; trained rows do
    assert torch.count_nonzero(grad[off]) == 0
    assert all(torch.count_nonzero(row) > 0 for row in grad[~off])
    # whatever the engine or the reference said about mask-0 tokens changes nothing
    assert torch.equal(loss, loss_noisy) and torch.equal(grad, grad_noisy)


def test_mismatch_metric_and_buffer_read_only_policy_tokens(encoder: PromptEncoder) -> None:
    from miles.train.step import StepStats

    samples = _multi_turn_samples(encoder)
    packed = pack(samples, [0, 1])
    on = packed.mask == 1
    logp = torch.where(on, packed.rollout_logp - 0.5, torch.full_like(packed.rollout_logp, -40.0))
    stats = StepStats()
    stats.add_mismatch(logp, packed.rollout_logp, packed.mask)
    assert stats["mismatch_tokens"] == 6 and stats["mismatch_sum"] / stats[
        "mismatch_tokens"
    ] == pytest.approx(0.5)
    # staleness: the oldest version of any generated token (observations carry their turn's version)
    wrong = samples[0]
    policy_versions = [v for v, m in zip(wrong.weight_versions, wrong.loss_mask, strict=True) if m]
    assert group_staleness(samples, 6) == 6 - min(policy_versions) == 3


def test_calculator_episode_with_standard_tool_call(encoder: PromptEncoder) -> None:
    """The built-in calculator environment through the same generate function: a `<tool_call>` turn
    of many tokens, the tool's value, the answer; mask 1 exactly on the two model turns."""
    from miles.agentic.envs.calculator import CalculatorEnv

    task = CalculatorEnv().make_task(SEED, INDEX)
    eos = encoder.eos_id
    call = encoder.tokenizer.encode(f"<tool_call>calc {task['expr']}</tool_call>", add_special_tokens=False)
    answer = encoder.tokenizer.encode(str(task["answer"]), add_special_tokens=False)
    turns = [([*call, eos], [-0.1] * (len(call) + 1), 2), ([*answer, eos], [-0.2] * (len(answer) + 1), 2)]
    cfg = RolloutConfig(generate_fn="miles.agentic.rollout:env_generate", env={"name": "calculator"})
    engine = ScriptedEngine(turns)
    gen = Generator.from_config([engine], encoder, lambda s: 0.0, cfg)  # type: ignore[list-item]
    prompt = Prompt(INDEX, "", None, {"episode": {"seed": SEED, "index": INDEX}})
    s = asyncio.run(gen.sample(prompt, 0, 0))
    assert encoder.decode(s.prompt_ids).endswith(f"{task['expr']}\nassistant\n")
    n_call, n_answer = len(call) + 1, len(answer) + 1
    n_obs = len(s.response_ids) - n_call - n_answer
    assert s.loss_mask == [1] * n_call + [0] * n_obs + [1] * n_answer
    observation = s.response_ids[n_call : n_call + n_obs]
    assert encoder.decode(observation) == f"\ntool\n{task['answer']}\nassistant\n"
    assert s.reward == 1.0 and s.metadata["agent"]["success"] == 1.0
    assert s.metadata["agent"]["tool_calls"] == 1 and s.metadata["agent"]["turns"] == 2


def test_sandbox_that_never_starts_drops_the_episode_with_its_reason(
    encoder: PromptEncoder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bubblewrap sandbox whose start fails (injected: no space left): the environment retries the
    start, then the episode is one FAILED sample whose reason is counted (agent/sandbox_failed); the
    buffer drops its group and the run goes on."""
    from miles.agentic.sandbox.bwrap import BwrapSandbox
    from miles.rollout.buffer import RolloutBuffer, load_policy
    from miles.rollout.producer import ProducerStats

    attempts = []

    async def no_space(self) -> None:
        attempts.append(1)
        raise OSError("no space left on device")

    monkeypatch.setattr(BwrapSandbox, "create", no_space)
    cfg = RolloutConfig(
        generate_fn="miles.agentic.rollout:env_generate",
        env={"name": "calculator", "options": {"backend": "sandbox"}},
    )
    gen = Generator.from_config([ScriptedEngine([])], encoder, lambda s: 0.0, cfg)  # type: ignore[list-item]
    prompt = Prompt(INDEX, "", None, {"episode": {"seed": SEED, "index": INDEX}})
    s = asyncio.run(gen.sample(prompt, 0, 0))
    assert len(attempts) == 3 and s.status is Status.FAILED
    assert "OSError" in s.metadata["error"] and "gave up after 3 attempts" in s.metadata["error"]
    stats = ProducerStats()
    stats.add([s])
    assert stats.take()["agent/sandbox_failed"] == 1.0
    buffer = RolloutBuffer(4, load_policy("drop_stale"), 1)
    assert buffer.put([s]) is False and len(buffer) == 0
