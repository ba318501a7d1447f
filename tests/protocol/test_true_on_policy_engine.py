"""True on-policy, engine against trainer: a real engine process started with SGLang's
`--enable-deterministic-inference --rl-on-policy-target fsdp` samples requests of different lengths
together (mixed prefill and decode batches of changing size, parallel samples, prompts continuing
cached prefixes), and the FSDP trainer's forward under train.true_on_policy (transformers' model with
miles/train/fsdp/true_on_policy.py installed, all sequences packed in one row as the trainer packs
them) gives every sampled token the same log-prob, bit for bit (`torch.equal`). Without the mode the
same comparison differs (so the test can fail)."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from miles.engine.process import start_engine
from miles.quant import invariant as inv

TEMPERATURE = 0.8
FLAGS = ["--enable-deterministic-inference", "--rl-on-policy-target", "fsdp"]


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    base = [rng.randrange(3, 380) for _ in range(30)]
    out = [base[:5], base[:17], base, [7, 8, 9], [rng.randrange(3, 380) for _ in range(45)]]
    return out + [base[:17] + [11, 12], base + [13]]  # continue cached prefixes


def _generate(url: str, prompt: list[int], seed: int, n: int = 1) -> list[dict]:
    body = {"input_ids": prompt, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 10 + seed % 7, "temperature": TEMPERATURE, "n": n,
                                "sampling_seed": seed, "ignore_eos": True}}  # fmt: skip
    out = httpx.post(url + "/generate", json=body, timeout=120).json()
    outs = out if isinstance(out, list) else [out]
    return [dict(prompt=prompt, output=o["output_ids"],
                 logprobs=[row[0] for row in o["meta_info"]["output_token_logprobs"]]) for o in outs]  # fmt: skip


def _rollout(url: str) -> list[dict]:
    prompts = _prompts()
    with ThreadPoolExecutor(8) as pool:  # together: batches of changing composition
        first = list(pool.map(lambda i: _generate(url, prompts[i], i, n=2 if i == 1 else 1), range(5)))
    later = [_generate(url, p, 10 + j) for j, p in enumerate(prompts[5:])]  # over cached prefixes
    return [s for group in first + later for s in group]


def _trainer_logprobs(model_dir: str, samples: list[dict], true_on_policy: bool) -> list[torch.Tensor]:
    """Each sample's response log-probs from one packed forward, as the FSDP backend computes them."""
    from transformers import AutoModelForCausalLM

    from miles.train.fsdp import true_on_policy as top

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
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
    with torch.no_grad():
        logits = model(
            input_ids=torch.tensor([ids]), position_ids=torch.tensor([pos]), use_cache=False
        ).logits[0]
    out = []
    for r, t in zip(rows, targets, strict=True):
        if true_on_policy:
            out.append(top.logprobs(logits, torch.tensor(r), torch.tensor(t), TEMPERATURE))
        else:
            out.append(
                torch.log_softmax(logits[r] / TEMPERATURE, -1).gather(1, torch.tensor(t)[:, None])[:, 0]
            )
    return out


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def model(request, tmp_path_factory) -> str:
    """Tiny models of both attention kinds: Qwen2 (q/k/v biases), Qwen3 (per-head q/k norms)."""
    from miles.models.tiny import init_tiny

    return str(init_tiny(tmp_path_factory.mktemp("models") / request.param, arch=request.param, seed=0))


@pytest.fixture(scope="module")
def rollouts(model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("true-on-policy")
    on = start_engine(model, device="cpu", log_path=logs / "on.log", extra_args=FLAGS, max_total_tokens=4096)
    off = start_engine(model, device="cpu", log_path=logs / "off.log", max_total_tokens=4096)
    try:
        info = httpx.get(on.url + "/server_info", timeout=30).json()
        yield info, _rollout(on.url), _rollout(off.url)
    finally:
        on.stop()
        off.stop()


def test_the_trainer_reproduces_every_sampled_log_prob_bit_for_bit(model, rollouts) -> None:
    info, samples, _ = rollouts
    assert info["enable_deterministic_inference"] is True and info["rl_on_policy_target"] == "fsdp"
    assert len(samples) == 8 and sum(len(s["output"]) for s in samples) > 80
    trainer = _trainer_logprobs(model, samples, true_on_policy=True)
    for s, got in zip(samples, trainer, strict=True):
        engine = torch.tensor(s["logprobs"], dtype=torch.float32)
        assert torch.equal(got, engine), (s["prompt"][:5], (got - engine).abs().max())


def test_without_the_mode_the_log_probs_differ(model, rollouts) -> None:
    _, _, samples = rollouts
    trainer = _trainer_logprobs(model, samples, true_on_policy=False)
    diffs = [
        (got - torch.tensor(s["logprobs"])).abs().max().item()
        for s, got in zip(samples, trainer, strict=True)
    ]
    assert max(diffs) > 0.0 and max(diffs) < 1e-3  # the same policy, other bits


def test_the_invariant_forward_refuses_what_it_does_not_cover(tiny_model) -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "miles.engine", "--model", tiny_model, "--device", "cpu",
                          *FLAGS, "--quantization", "fp8_block"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode != 0 and "--enable-deterministic-inference does not cover" in out.stderr


def test_greedy_and_sampled_log_probs_are_the_invariant_log_softmax() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    lp = inv.token_logprobs(logits, torch.tensor([1, 2, 3]), torch.tensor([1.0, 0.5, 2.0]))
    want = torch.stack([torch.log_softmax(logits[i] / t, -1)[i + 1] for i, t in enumerate((1.0, 0.5, 2.0))])
    torch.testing.assert_close(lp, want)
