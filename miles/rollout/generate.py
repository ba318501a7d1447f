"""Single-turn generation: one Prompt -> one scored Sample, through the SGLang client.

Prompts are wrapped in the model's chat template and tokenised here (token ids go to the engine,
token ids and per-token log-probs come back, so training sees exactly the sampled tokens). The
engine reports the weight version of every output token; with `in_place` weight updates a sample
can therefore carry several versions. A task may set per-prompt sampling overrides in
`prompt.metadata["sampling"]` (e.g. a length budget). A request aborted by a weight update (`abort` pause mode) is
sent again from scratch with the new weights, up to `max_attempts` times.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass
from typing import Any

from miles.config.rollout import RolloutConfig
from miles.rollout.client import EngineError, GenerateResult, SGLangClient
from miles.rollout.rewards import RewardFn
from miles.rollout.tasks import Prompt
from miles.sample import Sample, Status

_FINISH = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}


def parse_version(v: str | int) -> int:
    """Engine weight versions are strings; the initial weights ("default") are version 0."""
    try:
        return int(v)
    except (TypeError, ValueError):
        return 0


class PromptEncoder:
    """Chat template + tokeniser, loaded once from the model directory."""

    def __init__(self, model_path: str) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.eos_id: int = self.tokenizer.eos_token_id

    def encode(self, text: str) -> list[int]:
        out = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        # transformers 5 returns a BatchEncoding (a mapping), older versions a plain list
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids: given ones (`metadata["input_ids"]`, used as they are) or the
        templated text."""
        given = prompt.metadata.get("input_ids")
        return list(given) if given is not None else self.encode(prompt.text)

    def decode(self, ids: list[int]) -> str:
        # the Rust tokenizer directly: transformers' decode wrapper costs more than the decoding
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:
            return backend.decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids, skip_special_tokens=True)


@dataclass
class Generator:
    """Turns prompts into scored samples on a set of engines (round-robin when no router is used)."""

    clients: list[SGLangClient]
    encoder: PromptEncoder
    reward_fn: RewardFn
    sampling: dict[str, Any]
    max_attempts: int = 8

    def __post_init__(self) -> None:
        self._next = itertools.cycle(range(len(self.clients)))
        self.active = 0
        """/generate requests sent and not yet answered."""

    @classmethod
    def from_config(
        cls, clients: list[SGLangClient], encoder: PromptEncoder, reward_fn: RewardFn, cfg: RolloutConfig
    ) -> Generator:
        return cls(clients, encoder, reward_fn, sampling_params(cfg, encoder.eos_id))

    async def sample(
        self,
        prompt: Prompt,
        group_id: int,
        index: int,
        sampling: dict[str, Any] | None = None,
        prompt_ids: list[int] | None = None,
    ) -> Sample:
        """Generate, retrying aborted requests and unreachable engines, then score.

        Raises EngineError only for a 4xx answer (a bad request, which no retry can fix).
        """
        prompt_ids = list(prompt_ids) if prompt_ids is not None else self.encoder.prompt_ids(prompt)
        s = Sample(group_id, index, prompt_ids, prompt=prompt.text, answer=prompt.answer)
        s.metadata.update(prompt.metadata, prompt=prompt, attempts=0)
        params = {**(sampling or self.sampling), **prompt.metadata.get("sampling", {})}
        for attempt in range(1, self.max_attempts + 1):
            s.metadata["attempts"] = attempt
            client = self.clients[next(self._next)]
            self.active += 1
            try:
                r = await client.generate(prompt_ids, params)
            except EngineError as e:
                if e.status is not None and 400 <= e.status < 500:
                    raise  # the request itself is wrong: repeating it cannot help
                s.status, s.metadata["error"] = Status.FAILED, str(e)
                await asyncio.sleep(0.2 * attempt)
                continue
            finally:
                self.active -= 1
            s.status = _FINISH.get(r.finish_reason, Status.FAILED)
            if s.status is Status.ABORTED:
                continue
            await self.fill(s, r)
            return s
        return s

    async def fill(self, s: Sample, r: GenerateResult) -> None:
        """Copy one engine answer into the sample and score it."""
        s.status = _FINISH.get(r.finish_reason, Status.FAILED)
        s.response_ids = list(r.output_ids)
        s.rollout_logprobs = list(r.logprobs)
        s.loss_mask = [1] * len(s.response_ids)
        s.weight_versions = [parse_version(v) for v in r.weight_versions]
        s.response = self.encoder.decode(s.response_ids)
        s.reward = float(await asyncio.to_thread(self.reward_fn, s))


async def sample_group(
    gen: Generator, prompt: Prompt, group_id: int, n: int, prompt_ids: list[int]
) -> list[Sample]:
    """n samples of one prompt in one batched /generate; failed or aborted ones are redone singly."""
    params = {**gen.sampling, **prompt.metadata.get("sampling", {})}
    body = {"input_ids": [prompt_ids] * n, "sampling_params": params, "return_logprob": True}
    client = gen.clients[next(gen._next)]
    try:
        replies = (await client.request("POST", "/generate", body)).json()
    except EngineError as e:
        if e.status is not None and 400 <= e.status < 500:
            raise
        replies = [None] * n
    out = []
    for i, reply in enumerate(replies):
        r = GenerateResult.from_reply(reply) if reply else None
        if r is None or _FINISH.get(r.finish_reason) not in (Status.COMPLETED, Status.TRUNCATED):
            out.append(await gen.sample(prompt, group_id, i, prompt_ids=prompt_ids))
            continue
        s = Sample(group_id, i, list(prompt_ids), prompt=prompt.text, answer=prompt.answer)
        s.metadata.update(prompt.metadata, prompt=prompt, attempts=1)
        await gen.fill(s, r)
        out.append(s)
    return out


def sampling_params(cfg: RolloutConfig, eos_id: int, **override: Any) -> dict[str, Any]:
    """SGLang sampling_params for training rollouts (stop at the tokenizer's EOS)."""
    params = {
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "top_k": cfg.top_k,
        "max_new_tokens": cfg.max_new_tokens,
        "stop_token_ids": [eos_id],
    }
    params.update(override)
    return params
