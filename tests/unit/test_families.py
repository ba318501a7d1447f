"""Model families as plug-ins (miles/models/families/): the registry's lookups, and each family's facts
against transformers' own model of that family."""

from __future__ import annotations

import pytest
import torch

from miles.models.families import FAMILIES, family_of_model_type, get_family
from miles.models.tiny import model_config


def test_an_unknown_family_is_refused_listing_the_known_ones() -> None:
    with pytest.raises(
        ValueError, match=r"'GPT2LMHeadModel' is not supported; known: \['DeepseekV3ForCausalLM'"
    ):
        get_family("GPT2LMHeadModel")
    with pytest.raises(
        ValueError, match="model type 'gpt2' is not supported; known: deepseek_v3, deepseek_v4, llama, qwen2"
    ):
        family_of_model_type("gpt2")


GQA = [f for f in FAMILIES.values() if f.attention == "gqa"]


@pytest.mark.parametrize("family", GQA, ids=lambda f: f.model_type)
def test_each_family_names_the_attention_tensors_transformers_builds(family) -> None:
    from transformers import AutoModelForCausalLM

    cfg = model_config(family.model_type, 64, 1, 0)
    assert cfg.architectures is None or cfg.architectures[0] == family.hf_arch
    torch.manual_seed(0)
    names = set(AutoModelForCausalLM.from_config(cfg).state_dict())
    prefix = "model.layers.0."
    extra = {n for n in names if n.startswith(prefix + "self_attn.")} - {
        prefix + f"self_attn.{x}_proj.weight" for x in "qkvo"
    }
    assert extra == set(family.attention_names(prefix))
    assert family_of_model_type(cfg.model_type) is family
    assert any(".experts." in n for n in names) == family.moe


def test_a_plan_whose_rooms_cannot_load_the_family_is_refused_at_resolve(tmp_path, monkeypatch) -> None:
    import dataclasses

    from miles.config import ConfigError, resolve
    from miles.models.families import FAMILIES

    def plan(arch: str, **sections):
        base = {
            "run": {"runs_root": str(tmp_path)},
            "model": {"path": str(tmp_path / arch), "tiny": {"arch": arch}},
        }
        return resolve(base | sections)

    assert plan("deepseek_v4").engine.kind == "embedded"  # the engine and both trainers load it
    assert plan("deepseek_v4", train={"backend": "megatron"}).train.backend == "megatron"
    v4 = FAMILIES["DeepseekV4ForCausalLM"]  # a family Megatron would not load: refused, naming who does
    monkeypatch.setitem(FAMILIES, v4.hf_arch, dataclasses.replace(v4, backends=("engine", "fsdp")))
    with pytest.raises(
        ConfigError,
        match=r"train.backend=megatron cannot load DeepseekV4ForCausalLM .*set train.backend to fsdp",
    ):
        plan("deepseek_v4", train={"backend": "megatron"}, engine={"kind": "sglang"})
    monkeypatch.undo()
    assert plan("deepseek_v3").model.tiny.arch == "deepseek_v3"  # the engine and both trainers load it
    assert plan("deepseek_v3", train={"backend": "megatron"}).train.backend == "megatron"
    assert plan("deepseek_v4", engine={"kind": "sglang"}).engine.kind == "sglang"
