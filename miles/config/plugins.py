"""Functions named in a recipe by dotted path (`module:function`): rewards, scorers, generate and
agent functions, external evaluations. One loader, whose every error names the recipe key."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

from miles.config.base import ConfigError


def load_function(spec: str | None, key: str, builtins: Mapping[str, Callable[..., Any]] | None = None):
    """`module:function`, or a name of `builtins` -> the function; errors name `key` (e.g.
    `rollout.reward`) and what to write instead."""
    builtins = builtins or {}
    if spec in builtins:
        return builtins[spec]
    module_name, sep, fn_name = (spec or "").partition(":")
    if not sep or not module_name or not fn_name:
        known = f" or a built-in ({', '.join(builtins)})" if builtins else ""
        raise ConfigError(f"{key}={spec!r} must be `module:function`{known}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{key}={spec!r}: cannot import {module_name!r} ({e})") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ConfigError(f"{key}={spec!r}: {module_name} has no function {fn_name!r}")
    return fn
