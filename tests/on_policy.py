"""Shared by the true on-policy tests (protocol on the CPU, GPU): a rollout of requests of different
lengths sampled together from an engine, and the FSDP trainer's log-probs of the same tokens from one
packed forward (transformers' model, with or without miles/train/fsdp/true_on_policy.py installed)."""

from __future__ import annotations

import contextlib
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import torch

TEMPERATURE = 0.8
FLAGS = ["--enable-deterministic-inference", "--rl-on-policy-target", "fsdp"]


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    base = [rng.randrange(3, 380) for _ in range(30)]
    out = [base[:5], base[:17], base, [7, 8, 9], [rng.randrange(3, 380) for _ in range(45)]]
    return out + [base[:17] + [11, 12], base + [13]]  # continue cached prefixes


def _generate(url: str, prompt: list[int], seed: int, n: int = 1, routed: bool = False) -> list[dict]:
    body = {"input_ids": prompt, "return_logprob": True, "return_routed_experts": routed,
            "sampling_params": {"max_new_tokens": 10 + seed % 7, "temperature": TEMPERATURE, "n": n,
                                "sampling_seed": seed, "ignore_eos": True}}  # fmt: skip
    out = httpx.post(url + "/generate", json=body, timeout=120).json()
    outs = out if isinstance(out, list) else [out]
    return [dict(prompt=prompt, output=o["output_ids"], routed=o["meta_info"].get("routed_experts"),
                 logprobs=[row[0] for row in o["meta_info"]["output_token_logprobs"]]) for o in outs]  # fmt: skip


def rollout(url: str, routed: bool = False) -> list[dict]:
    """`routed`: each sample also carries the engine's routed experts (SGLang's base64 rows)."""
    prompts = _prompts()
    gen = lambda p, seed, n=1: _generate(url, p, seed, n, routed)  # noqa: E731
    with ThreadPoolExecutor(8) as pool:  # together: batches of changing composition
        first = list(pool.map(lambda i: gen(prompts[i], i, 2 if i == 1 else 1), range(5)))
    later = [gen(p, 10 + j) for j, p in enumerate(prompts[5:])]  # over cached prefixes
    return [s for group in first + later for s in group]


def _replay(model, samples: list[dict]):
    """Routing replay installed on `model` and the packed row's routing from the samples' rows."""
    from miles.rollout.client import decode_routed_experts
    from miles.sample import Sample
    from miles.train.routing_replay import RoutingReplay, packed_routing

    rr = RoutingReplay.install(model, replay=True)
    packed = []
    for i, s in enumerate(samples):
        tokens = s["prompt"] + s["output"]
        rows = decode_routed_experts(s["routed"], len(tokens) - 1)
        packed.append(
            Sample(group_id=i, index=0, prompt_ids=s["prompt"], response_ids=s["output"], routed_experts=rows)
        )
    return rr, packed_routing(packed, range(len(packed)), rr.shape, required=True)


def trainer_logprobs(
    model_dir: str,
    samples: list[dict],
    true_on_policy: bool,
    device: str = "cpu",
    dtype=torch.float32,
    replay: bool = False,
) -> list[torch.Tensor]:
    """Each sample's response log-probs from one packed forward, as the FSDP backend computes them
    (`replay`: the MoE routers follow the samples' routed experts, routing replay)."""
    from transformers import AutoModelForCausalLM

    from miles.train.fsdp import true_on_policy as top

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").to(
        device
    )
    if true_on_policy:
        top.install(model)
    ids, pos, rows, targets = [], [], [], []
    for s in samples:
        seq = s["prompt"] + s["output"]
        start = len(ids)
        rows.append(list(range(start + len(s["prompt"]) - 1, start + len(seq) - 1)))
        targets.append(s["output"])
        ids += seq
        pos += range(len(seq))
    rr, routing = _replay(model, samples) if replay else (None, None)
    with torch.no_grad(), rr.batch(routing, measure=False) if rr else contextlib.nullcontext():
        batch = dict(
            input_ids=torch.tensor([ids], device=device), position_ids=torch.tensor([pos], device=device)
        )
        logits = model(**batch, use_cache=False).logits[0]
    out = []
    for r, t in zip(rows, targets, strict=True):
        if true_on_policy:
            out.append(
                top.logprobs(
                    logits, torch.tensor(r, device=device), torch.tensor(t, device=device), TEMPERATURE
                ).cpu()
            )
        else:
            out.append(
                torch.log_softmax(logits[r].float() / TEMPERATURE, -1)
                .gather(1, torch.tensor(t, device=device)[:, None])[:, 0]
                .cpu()
            )
    return out


def chunked_prefill_logits(model_dir: str, device: str, dtype, invariant: bool, chunk: int = 7):
    """The engine decoder's logits after a 40-token prompt computed (a) in one prefill beside a
    second request and (b) in chunks of `chunk` tokens alone, each chunk over the cached K/V of the
    ones before (chunked prefill): ([V] whole, [V] chunked)."""
    from types import SimpleNamespace

    from miles.engine.model import Decoder, ModelSpec, load_weights
    from miles.engine.request import prefill_batch

    dec = Decoder(ModelSpec.from_dir(model_dir), load_weights(model_dir), device, dtype)
    if invariant:
        dec.make_invariant()
    prompt = [(13 * i) % 300 + 3 for i in range(40)]
    other = [(7 * i) % 250 + 5 for i in range(23)]
    pool = dec.new_kv_pool(256)
    table = torch.arange(256, device=dec.device).view(2, 128)
    req = lambda toks, row, done: SimpleNamespace(tokens=toks, kv_len=done, row=row, slots=toks)  # noqa: E731
    whole = dec.forward(prefill_batch([req(other, 1, 0), req(prompt, 0, 0)], table), pool)[1]
    pool = dec.new_kv_pool(256)
    for start in range(0, len(prompt), chunk):
        done = prompt[: start + chunk]
        last = dec.forward(prefill_batch([req(done, 0, start)], table), pool)[0]
    return whole.float().cpu(), last.float().cpu()
