"""Scoring the student's samples with a distillation teacher (train.distill; maths in miles/train/distill.py).

A teacher is any server that speaks SGLang's protocol (a real SGLang server, or the embedded engine
Miles starts for `train.distill.teacher_model`). Each group of samples is scored with one batched
`/generate` call as soon as it is generated, while other groups are still generating:

    {"input_ids": [prompt + response, ...], "sampling_params": {"max_new_tokens": 0},
     "return_logprob": true, "logprob_start_len": [len(prompt) - 1, ...]}

SGLang answers `meta_info.input_token_logprobs` from position logprob_start_len on, the first row
without a value (nothing before it is scored), so rows 1.. are the log-probs of the response tokens
given their prefix under the teacher: `Sample.teacher_logprobs`. With `top_k` (train.distill.mode =
topk_reverse_kl) the body adds `"top_logprobs_num": top_k` and rows 1.. of `input_top_logprobs`,
each a list of (log-prob, token id, text), become `Sample.teacher_topk` instead. Samples whose prompt metadata holds
`train.distill.teacher_key` go to that teacher (an index into the teachers); the others are spread
over the teachers in turn. A teacher must tokenise as the student does: `check_tokenizer` compares
the ids both give for probe texts before training starts.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import numpy as np

from miles.config import ConfigError
from miles.rollout.client import SGLangClient
from miles.sample import Sample, Status

PROBES = ("Distillation probe: 12 + 30 = 42.", "<|im_start|>user\nlast digit: 3 8<|im_end|>")


class Teacher:
    """The teachers of one run and the scoring of groups of samples on them."""

    def __init__(self, clients: list[SGLangClient], key: str | None = None, top_k: int = 0) -> None:
        if not clients:
            raise ValueError("a teacher needs at least one server")
        self.clients = clients
        self.key = key
        self.top_k = top_k
        """Teacher top-k per position (0: only the sampled token's log-prob)."""
        self._turn = itertools.cycle(range(len(clients)))
        self.busy_s = 0.0
        """Wall seconds with at least one scoring call in flight since the last `take_busy_s` (calls
        overlap; each second counts once)."""
        self._active = 0
        self._since = 0.0

    def _client_of(self, s: Sample) -> SGLangClient:
        if self.key is not None and self.key in s.metadata:
            choice = int(s.metadata[self.key])
            if not 0 <= choice < len(self.clients):
                raise ValueError(
                    f"prompt metadata {self.key}={choice} (train.distill.teacher_key) names no teacher: "
                    f"there are {len(self.clients)}"
                )
            return self.clients[choice]
        return self.clients[next(self._turn)]

    async def score(self, group: list[Sample]) -> None:
        """Fill `teacher_logprobs` of the group's completed samples, one batched call per teacher."""
        self._enter()
        by_client: dict[int, tuple[SGLangClient, list[Sample]]] = {}
        for s in group:
            if s.status in (Status.COMPLETED, Status.TRUNCATED) and s.response_ids:
                c = self._client_of(s)
                by_client.setdefault(id(c), (c, []))[1].append(s)
        try:
            await asyncio.gather(*(self._score_on(c, samples) for c, samples in by_client.values()))
        finally:
            self._leave()

    def _enter(self) -> None:
        if self._active == 0:
            self._since = time.perf_counter()
        self._active += 1

    def _leave(self) -> None:
        self._active -= 1
        if self._active == 0:
            self.busy_s += time.perf_counter() - self._since

    async def _score_on(self, client: SGLangClient, samples: list[Sample]) -> None:
        body = {
            "input_ids": [s.tokens for s in samples],
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": [len(s.prompt_ids) - 1 for s in samples],
        }
        if self.top_k:
            body["top_logprobs_num"] = self.top_k
        replies = (await client.request("POST", "/generate", body)).json()
        for s, reply in zip(samples, replies, strict=True):
            meta = reply["meta_info"]
            rows = meta["input_token_logprobs"][1:]
            if len(rows) != s.response_length:
                raise RuntimeError(
                    f"teacher {client.url} scored {len(rows)} tokens of a {s.response_length}-token response"
                )
            if self.top_k:
                s.teacher_topk = _topk_arrays(
                    meta.get("input_top_logprobs") or [], s.response_length, self.top_k
                )
            else:
                s.teacher_logprobs = [float(row[0]) for row in rows]

    def take_busy_s(self) -> float:
        """The busy wall time since the last call (a call still in flight counts up to now)."""
        now = time.perf_counter()
        if self._active:
            self.busy_s += now - self._since
            self._since = now
        busy, self.busy_s = self.busy_s, 0.0
        return busy


def _topk_arrays(rows: list[Any], n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids [n, k] int64, log-probs [n, k] float32) from `input_top_logprobs` (its first row, which
    no context predicts, dropped)."""
    rows = rows[1:]
    if len(rows) != n or any(row is None or len(row) != k for row in rows):
        raise RuntimeError(
            f"the teacher returned top-{k} log-probs for {len(rows)} of {n} response tokens "
            "(a server that ignores top_logprobs_num cannot serve train.distill.mode=topk_reverse_kl)"
        )
    ids = np.array([[int(e[1]) for e in row] for row in rows], dtype=np.int64).reshape(n, k)
    logp = np.array([[float(e[0]) for e in row] for row in rows], dtype=np.float32).reshape(n, k)
    return ids, logp


async def check_tokenizer(client: SGLangClient, encode: Any) -> None:
    """ConfigError unless the teacher's /tokenize gives the student's ids (`encode`) for the probes."""
    for text in PROBES:
        theirs = (
            await client.request("POST", "/tokenize", {"prompt": text, "add_special_tokens": False})
        ).json()
        ids = theirs.get("tokens", theirs.get("input_ids"))
        if ids != encode(text):
            raise ConfigError(
                f"the teacher at {client.url} tokenises {text!r} as {ids}, the student as {encode(text)}: "
                "on-policy distillation needs the same tokenizer (train.distill)"
            )


def tokenizer_difference(student_dir: str, teacher_dir: str) -> str | None:
    """Why the tokenizers of two model directories differ on the probes, or None when they agree."""
    from transformers import AutoTokenizer

    student, teacher = (AutoTokenizer.from_pretrained(d) for d in (student_dir, teacher_dir))
    for text in PROBES:
        a, b = student.encode(text, add_special_tokens=False), teacher.encode(text, add_special_tokens=False)
        if a != b:
            return f"{teacher_dir} tokenises {text!r} as {b}, the student ({student_dir}) as {a}"
    return None
