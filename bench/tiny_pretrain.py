"""Seconds per pretraining step of the coding corpus' tiny base model with N torch threads.

    python -m bench.tiny_pretrain --threads 1 [--steps 40]

The same function `miles train` runs to make `model.tiny.pretrain_steps` base models
(miles.models.tiny.pretrain), after 5 warm-up steps (tokenising the corpus is not timed); prints one line `threads=N s/step=X`.
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    from miles.models.tiny import base_text, build_tokenizer, model_config, pretrain

    torch.set_num_threads(args.threads)
    tok = build_tokenizer(512, 0, "coding")
    cfg = model_config("qwen2", len(tok), tok.eos_token_id, tok.pad_token_id)
    docs = base_text("coding", 20_000, 0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    marks: dict[int, float] = {}
    pretrain(
        model,
        tok,
        docs,
        5 + args.steps,
        0,
        report=lambda step, _: marks.setdefault(step, time.perf_counter()),
    )
    print(f"threads={args.threads} s/step={(marks[5 + args.steps] - marks[5]) / args.steps:.3f}")


if __name__ == "__main__":
    main()
