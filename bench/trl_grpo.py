"""TRL's GRPOTrainer on one GPU: the baseline side of the end-to-end GRPO benchmark.

    python3 -m bench.trl_grpo --steps 4 --out trl.json        # H200: TRL 1.16 from the wheels in .whl/
    python3 -m bench.trl_grpo --steps 2 --out trl.json --tiny # CPU smoke test, well under a minute

Workload (the issue's): a random-init Qwen2 model with Qwen2.5-0.5B's shapes and vocabulary (tied
embeddings, like the real checkpoint and bench/engine_gpu.py), bf16 on CUDA; 32 prompts of exactly
128 tokens, 8 completions each, every completion exactly 512 tokens; one optimizer step per 32 x 8.
No tokenizer can be downloaded, so prompts come from miles' small BPE tokenizer
(miles.models.tiny.build_tokenizer); the model still samples from all 151,936 ids, and ids past the
tokenizer's decode to nothing, which only changes the completion text TRL hands to reward functions.

TRL settings, and why:
- HF `generate` (use_vllm=False: TRL's generation path without a vLLM server), sampling at temperature
  1, top_p 1, top_k 0 (TRL's defaults). Quoted results name this mode, and both gradient-checkpointing
  settings (on by default, off with --no-gradient-checkpointing; bench/h200_sitting.sh runs both).
- Completions forced to full length: `generation_kwargs={"min_new_tokens": C}` makes transformers mask
  every id of the generation config's eos list (TRL puts the tokenizer's eos and the model's there)
  until C tokens exist, and max_completion_length=C stops there. The run fails if any is shorter.
- TRL 1.16 has no max_prompt_length: prompts are built so that TRL's own tokenisation of them,
  `tokenizer(text=prompts)["input_ids"]`, is exactly P tokens each, and that is asserted.
- Batch mapping. TRL counts batches in completions, not prompts:
      per_device_train_batch_size = M        completions per forward/backward (default 16)
      gradient_accumulation_steps = P*G/M    so one optimizer step sees all P*G = 256 completions
      steps_per_generation        = P*G/M    (TRL's default: = gradient_accumulation_steps)
      generation_batch_size       = M * steps_per_generation = P*G = 256
  so one `generate` call produces the 256 completions at the first micro-step of each optimizer step
  and the following micro-steps train on slices of that buffer. Because steps_per_generation equals
  gradient_accumulation_steps and num_iterations=1, the update is on-policy and TRL skips the extra
  old-log-prob forward.
- beta=0 (TRL 1.16's default: no reference model), loss_type "dapo", scale_rewards "group", epsilon
  0.2, learning_rate 1e-6, gradient checkpointing on (TRL's defaults); model weights in bf16 with
  bf16=True, as TRL loads a bf16 checkpoint; logging every step, no saving, report_to none.
- Reward: the fraction of even token ids in the completion. Trivial to compute, but it differs
  between the completions of a group, so advantages and gradients are not zero.

Timing: a TrainerCallback stamps on_step_begin / on_step_end (CUDA synchronised) around each optimizer
step; the first step is warm-up and is left out of the median. `generate` is wrapped to time the
rollout share of each step. Generated tokens/s = P*G*C / median step time.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

from miles.models.tiny import QWEN25_05B_SHAPE, QWEN25_EOS, QWEN25_PAD, QWEN25_VOCAB, build_tokenizer

FULL = dict(prompts=32, generations=8, prompt_len=128, completion_len=512, micro_batch=16)
TINY = dict(prompts=4, generations=4, prompt_len=16, completion_len=32, micro_batch=4)


def build_model(tok, tiny: bool, tied: bool, device: str, dtype: torch.dtype):
    """The random-init policy: Qwen2.5-0.5B shapes and vocabulary, or the tiny test shape."""
    from transformers import AutoModelForCausalLM

    from miles.models.tiny import model_config

    if tiny:
        cfg = model_config("qwen2", len(tok), tok.eos_token_id, tok.pad_token_id)
    else:
        cfg = model_config(
            "qwen2", QWEN25_VOCAB, QWEN25_EOS, QWEN25_PAD, max_position_embeddings=32768, **QWEN25_05B_SHAPE
        )
    cfg.tie_word_embeddings = tied
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype)


def make_prompts(tok, n: int, length: int, seed: int = 0) -> list[str]:
    """n texts that TRL tokenises to exactly `length` tokens each.

    Each text is a run of " word" pieces that are single tokens of the vocabulary; the byte-level
    pre-tokeniser splits text at every space-letter boundary, so no merge can join two pieces.
    """
    pieces = []
    for token, token_id in tok.get_vocab().items():
        text = tok.convert_tokens_to_string([token])
        if text.startswith(" ") and text[1:].isalpha() and tok(text=text)["input_ids"] == [token_id]:
            pieces.append(text)
    if len(pieces) < 16:
        raise RuntimeError(f"the tokenizer has only {len(pieces)} single-token words; cannot build prompts")
    rng = random.Random(seed)
    prompts = ["".join(rng.choice(pieces) for _ in range(length)) for _ in range(n)]
    lengths = {len(ids) for ids in tok(text=prompts)["input_ids"]}
    assert lengths == {length}, f"prompt token lengths {lengths}, wanted {length}"
    return prompts


def parity_reward(completion_ids: list[list[int]], **_) -> list[float]:
    """Fraction of even token ids: cheap, and different across a group's completions."""
    return [sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1) for ids in completion_ids]


class StepTimer(TrainerCallback):
    """Wall time of each optimizer step, and of `generate` calls, with CUDA synchronised."""

    def __init__(self) -> None:
        self.begin: list[float] = []
        self.end: list[float] = []
        self.generate_s: list[float] = []

    @staticmethod
    def now() -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_step_begin(self, args, state, control, **kwargs):
        self.begin.append(self.now())

    def on_step_end(self, args, state, control, **kwargs):
        self.end.append(self.now())

    def wrap_generate(self, model) -> None:
        inner = model.generate

        def timed_generate(*a, **kw):
            t0 = self.now()
            out = inner(*a, **kw)
            self.generate_s.append(self.now() - t0)
            return out

        model.generate = timed_generate


def grpo_config(a: argparse.Namespace, out_dir: str, bf16: bool):
    """GRPOConfig for one optimizer step per generation of prompts x generations (see module doc)."""
    from trl import GRPOConfig

    total = a.prompts * a.generations
    if total % a.micro_batch:
        raise SystemExit(f"--micro-batch {a.micro_batch} must divide prompts x generations = {total}")
    accum = total // a.micro_batch
    cfg = GRPOConfig(
        output_dir=out_dir,
        max_steps=a.steps,
        per_device_train_batch_size=a.micro_batch,
        gradient_accumulation_steps=accum,
        num_generations=a.generations,
        max_completion_length=a.completion_len,
        generation_kwargs={"min_new_tokens": a.completion_len},
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        num_iterations=1,
        learning_rate=1e-6,
        gradient_checkpointing=not a.no_gradient_checkpointing,
        bf16=bf16,
        use_vllm=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    assert cfg.generation_batch_size == total and cfg.steps_per_generation == accum, (
        cfg.generation_batch_size,
        cfg.steps_per_generation,
    )
    return cfg


def run(a: argparse.Namespace) -> dict:
    """Train `a.steps` GRPO steps with TRL and return the measurements."""
    import transformers
    import trl
    from datasets import Dataset
    from trl import GRPOTrainer

    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    t0 = time.perf_counter()
    tok = build_tokenizer()
    model = build_model(tok, a.tiny, not a.untied, "cuda" if cuda else "cpu", dtype)
    prompts = make_prompts(tok, a.prompts, a.prompt_len)
    timer = StepTimer()
    timer.wrap_generate(model)
    with tempfile.TemporaryDirectory() as out_dir:
        cfg = grpo_config(a, out_dir, bf16=cuda)
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=parity_reward,
            args=cfg,
            train_dataset=Dataset.from_dict({"prompt": prompts}),
            processing_class=tok,
            callbacks=[timer],
        )
        build_s = time.perf_counter() - t0
        trainer.train()
    logs = [e for e in trainer.state.log_history if "completions/min_length" in e]
    short = [e["completions/min_length"] for e in logs if e["completions/min_length"] < a.completion_len]
    if short:
        raise RuntimeError(f"completions shorter than {a.completion_len} tokens: min lengths {short}")
    if len(timer.generate_s) != a.steps or len(timer.end) != a.steps:
        raise RuntimeError(
            f"{len(timer.generate_s)} generate calls in {len(timer.end)} steps, wanted one per step"
        )
    return summarise(a, cfg, timer, logs, build_s) | {
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "trl": trl.__version__,
        },
        "device": torch.cuda.get_device_name() if cuda else "cpu",
    }


def summarise(a: argparse.Namespace, cfg, timer: StepTimer, logs: list[dict], build_s: float) -> dict:
    steps = [e - b for b, e in zip(timer.begin, timer.end, strict=True)]
    step_s = statistics.median(steps[1:])
    gen_s = statistics.median(timer.generate_s[1:])
    tokens = a.prompts * a.generations * a.completion_len
    cuda = torch.cuda.is_available()
    return {
        "workload": {k: getattr(a, k) for k in (*FULL, "steps", "tiny", "untied")},
        "settings": {
            k: getattr(cfg, k)
            for k in (
                "per_device_train_batch_size",
                "gradient_accumulation_steps",
                "steps_per_generation",
                "generation_batch_size",
                "num_generations",
                "max_completion_length",
                "generation_kwargs",
                "beta",
                "loss_type",
                "scale_rewards",
                "epsilon",
                "learning_rate",
                "gradient_checkpointing",
                "bf16",
                "use_vllm",
            )
        },
        "build_s": build_s,
        "step_s_all": steps,
        "generate_s_all": timer.generate_s,
        "step_s_median": step_s,
        "generate_s_median": gen_s,
        "train_s_median": step_s - gen_s,
        "generated_tokens_per_step": tokens,
        "generated_tokens_per_s": tokens / step_s,
        "generate_tokens_per_s": tokens / gen_s,
        "steps_per_hour": 3600 / step_s,
        "peak_gpu_mem_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else None,
        "peak_gpu_reserved_gb": torch.cuda.max_memory_reserved() / 1e9 if cuda else None,
        "log": [
            {k: e.get(k) for k in ("step", "loss", "reward", "completions/mean_length", "step_time")}
            for e in logs
        ],
    }


def print_table(r: dict) -> None:
    w = r["workload"]
    n = len(r["step_s_all"]) - 1
    print(f"\nTRL {r['versions']['trl']} GRPO on {r['device']}: {w['prompts']} prompts x {w['generations']}")
    print(
        f"completions, prompt {w['prompt_len']}, completion {w['completion_len']} tokens; median of {n} steps"
    )
    rows = [
        ("s/step", f"{r['step_s_median']:.2f}"),
        ("  generate s", f"{r['generate_s_median']:.2f}"),
        ("  train s (rest of the step)", f"{r['train_s_median']:.2f}"),
        ("steps/hour", f"{r['steps_per_hour']:.0f}"),
        ("generated tokens/s (per step)", f"{r['generated_tokens_per_s']:.0f}"),
        ("generate tokens/s", f"{r['generate_tokens_per_s']:.0f}"),
        ("peak GPU memory GB", "n/a" if r["peak_gpu_mem_gb"] is None else f"{r['peak_gpu_mem_gb']:.1f}"),
        ("model + trainer build s", f"{r['build_s']:.1f}"),
    ]
    for name, value in rows:
        print(f"{name:<32}{value:>10}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4, help="optimizer steps, the first one is warm-up")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--tiny", action="store_true", help="tiny model and lengths: a CPU smoke test")
    p.add_argument("--prompts", type=int, help="prompts per step (32; tiny 4)")
    p.add_argument("--generations", type=int, help="completions per prompt (8; tiny 4)")
    p.add_argument("--prompt-len", type=int, help="prompt tokens (128; tiny 16)")
    p.add_argument("--completion-len", type=int, help="completion tokens (512; tiny 32)")
    p.add_argument("--micro-batch", type=int, help="completions per forward/backward (16; tiny 4)")
    p.add_argument("--untied", action="store_true", help="untie the LM head from the embedding")
    p.add_argument("--no-gradient-checkpointing", action="store_true", help="turn off TRL's default")
    a = p.parse_args()
    for key, value in (TINY if a.tiny else FULL).items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    if a.steps < 2:
        p.error("--steps must be at least 2: the first step is warm-up")
    result = run(a)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    print_table(result)


if __name__ == "__main__":
    main()
