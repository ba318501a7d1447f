"""train.true_on_policy: what it needs is refused by name at resolve time, the engines get SGLang's
deterministic-inference flags from it, and a server of engine.urls without them is refused."""

from __future__ import annotations

import pytest

from miles.config import ConfigError, resolve
from miles.launch.external import check_deterministic
from miles.rollout.engine_argv import engine_argv


def test_the_engines_get_the_deterministic_inference_flags() -> None:
    plan = resolve({}, ["train.true_on_policy=true"])
    argv = engine_argv(plan)
    assert argv[argv.index("--rl-on-policy-target") + 1] == "fsdp"
    assert "--enable-deterministic-inference" in argv
    assert "--enable-deterministic-inference" not in engine_argv(resolve({}))


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("train.backend=megatron", "train.backend=fsdp"),
        ("engine.quantization=fp8_block", "engine.quantization"),
        ("engine.speculative.draft_model_path=/tmp/d", "engine.speculative"),
    ],
)
def test_what_it_cannot_hold_with_is_refused_by_name(override, named) -> None:
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        resolve({}, ["train.true_on_policy=true", override])


def test_a_server_without_deterministic_inference_is_refused() -> None:
    plan = resolve({}, ["train.true_on_policy=true"])
    with pytest.raises(ConfigError, match="--enable-deterministic-inference --rl-on-policy-target fsdp"):
        check_deterministic("http://127.0.0.1:1", {"enable_deterministic_inference": False}, plan)
    check_deterministic(
        "http://127.0.0.1:1", {"enable_deterministic_inference": True, "rl_on_policy_target": "fsdp"}, plan
    )
    check_deterministic("http://127.0.0.1:1", {}, resolve({}))  # the mode off: nothing asked
