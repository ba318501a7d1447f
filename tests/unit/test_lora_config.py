"""train.lora's rules (ConfigError naming the key to change) and the engine flags a LoRA run starts
its engines and SGLang servers with."""

from __future__ import annotations

import pytest

from miles.config import ConfigError, resolve
from miles.rollout.engine_argv import engine_argv

LORA = {"rank": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj", "lm_head"]}


def test_lora_plan_and_engine_flags():
    plan = resolve({"train": {"lora": LORA}})
    argv = engine_argv(plan)
    i = argv.index("--enable-lora")
    assert argv[i : i + 7] == [
        "--enable-lora",
        "--max-lora-rank",
        "8",
        "--lora-target-modules",
        "q_proj",
        "v_proj",
        "lm_head",
    ]
    assert "--enable-lora" not in engine_argv(resolve({}))  # a full-parameter run serves no adapters


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"train": {"backend": "megatron", "expert_parallel": 2}}, "train.expert_parallel=1"),
        ({"train": {"backend": "megatron"}, "_lora": {"dropout": 0.1}}, "dropout must be 0"),
        ({"engine": {"quantization": "fp8_row"}}, "engine.quantization=none"),
        ({"train": {"loss": {"advantage": "ppo"}}}, "advantage=grpo"),
        ({"weights": {"transport": "disk"}}, "weights.transport=distributed"),
    ],
)
def test_lora_refuses_what_it_is_not_built_for(extra, message):
    recipe = {"train": {"lora": dict(LORA)}}
    for section, values in extra.items():
        if section == "_lora":
            recipe["train"]["lora"].update(values)
        else:
            recipe.setdefault(section, {}).update(values)
    with pytest.raises(ConfigError, match=message):
        resolve(recipe)


def test_megatron_lora_takes_tensor_and_pipeline_parallelism():
    lora = {"rank": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    plan = resolve(
        {
            "train": {
                "backend": "megatron",
                "num_ranks": 4,
                "tensor_parallel": 2,
                "pipeline_parallel": 2,
                "lora": lora,
            }
        }
    )
    assert (plan.train.tensor_parallel, plan.train.pipeline_parallel) == (2, 2)


def test_unknown_target_and_bad_name_are_refused():
    with pytest.raises(ConfigError, match="target_modules"):
        resolve({"train": {"lora": {"target_modules": ["embed_tokens"]}}})
    with pytest.raises(ConfigError, match="name"):
        resolve({"train": {"lora": {"name": "bad name/x"}}})
