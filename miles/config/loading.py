"""Reading recipes and applying `--set key=value` overrides, before any validation."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import yaml

from miles.config.base import ConfigError

_BOOL = "tag:yaml.org,2002:bool"


class _Loader(yaml.SafeLoader):
    """YAML's safe loader with YAML 1.2 booleans: only true/false. YAML 1.1 (PyYAML's default) also
    reads on/off/yes/no as booleans, which would turn `routing_replay: off` or `tis: off` into False."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != _BOOL]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))


def load_yaml(text: str) -> Any:
    """Parse YAML text as recipes are read (YAML 1.2 booleans)."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping; a missing file or non-mapping content is a ConfigError."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(
            f"recipe file {str(p)!r} does not exist; pass the path of a YAML recipe (see recipes/)"
        )
    try:
        data = load_yaml(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{p} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"{p} must hold a mapping of sections (run:, model:, rollout:, ...), not {type(data).__name__}"
        )
    return data


def parse_override(text: str) -> tuple[list[str], Any]:
    """`rollout.temperature=0.7` -> (["rollout", "temperature"], 0.7); the value is parsed as YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r} must look like section.key=value, e.g. rollout.temperature=0.7")
    value = load_yaml(raw) if raw.strip() else None
    return key.strip().split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of `data` with each dotted override applied (later ones win)."""
    out = copy.deepcopy(data)
    for text in overrides:
        path, value = parse_override(text)
        node = out
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {part!r} is a value, not a section")
            node = child
        node[path[-1]] = value
    return out


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """Merge `top` over `base` recursively (mappings merge, everything else is replaced)."""
    out = copy.deepcopy(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out
