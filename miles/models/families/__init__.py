"""The model families Miles serves and trains, one module each, registered here by the Hugging Face
architecture name (`architectures[0]` of config.json).

A family states the facts the engine's decoder and the trainers' model builders branch on (biases,
norms, experts); adding a family is adding a module and its line below. Unknown names are refused
with the known ones listed.
"""

from __future__ import annotations

from miles.models.families import deepseek_v3, deepseek_v4, llama, qwen2, qwen3, qwen3_moe
from miles.models.families.base import Family

FAMILIES: dict[str, Family] = {
    f.hf_arch: f
    for f in (
        llama.FAMILY,
        qwen2.FAMILY,
        qwen3.FAMILY,
        qwen3_moe.FAMILY,
        deepseek_v3.FAMILY,
        deepseek_v4.FAMILY,
    )
}


def get_family(hf_arch: str) -> Family:
    """The family of an HF architecture name; ValueError listing the known ones otherwise."""
    if hf_arch not in FAMILIES:
        raise ValueError(f"model architecture {hf_arch!r} is not supported; known: {sorted(FAMILIES)}")
    return FAMILIES[hf_arch]


def family_of_model_type(model_type: str) -> Family:
    """The family of a config's `model_type` (what the trainers read); ValueError listing the known ones."""
    for f in FAMILIES.values():
        if f.model_type == model_type:
            return f
    known = sorted(f.model_type for f in FAMILIES.values())
    raise ValueError(f"model type {model_type!r} is not supported; known: {', '.join(known)}")


def packs_sequences(model_type: str) -> bool:
    """Whether transformers' forward of `model_type` keeps packed sequences apart (Family.packs);
    True for a model type of no registered family."""
    return next((f.packs for f in FAMILIES.values() if f.model_type == model_type), True)


__all__ = ["FAMILIES", "Family", "family_of_model_type", "get_family", "packs_sequences"]
