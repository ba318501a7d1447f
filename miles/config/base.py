"""The base of every config section: frozen pydantic models that reject unknown keys.

A misspelt key is the most common recipe bug, so the error names the key, where it is, and the
closest valid keys. Sections only validate; all derivation happens in `miles.config.resolve`.
"""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError


class ConfigError(ValueError):
    """A user-facing configuration problem; the message says which key to change and how."""


class Section(BaseModel):
    """Base class for config sections: frozen, unknown keys rejected, docstrings become docs."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


def _nearest(key: str, model: type[BaseModel] | None) -> list[str]:
    if model is None:
        return []
    return difflib.get_close_matches(key, list(model.model_fields), n=3, cutoff=0.5)


def _model_at(root: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The section model that owns the field at `loc` (all but the last element)."""
    model: type[BaseModel] | None = root
    for part in loc[:-1]:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            return None
        ann = model.model_fields[part].annotation
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    return model


def explain(error: ValidationError, root: type[BaseModel], source: str = "config") -> ConfigError:
    """Turn a pydantic ValidationError into a ConfigError naming each bad key and a fix."""
    lines = []
    for item in error.errors():
        loc = tuple(item["loc"])
        dotted = ".".join(str(p) for p in loc)
        if item["type"] == "extra_forbidden":
            near = _nearest(str(loc[-1]), _model_at(root, loc))
            hint = (
                f"; did you mean {', '.join(repr('.'.join([*map(str, loc[:-1]), n])) for n in near)}?"
                if near
                else ""
            )
            lines.append(f"unknown key {dotted!r}{hint}")
        else:
            lines.append(f"{dotted}: {item['msg']} (got {item.get('input')!r})")
    return ConfigError(f"invalid {source}:\n  " + "\n  ".join(lines))
