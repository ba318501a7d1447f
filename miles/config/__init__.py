"""Typed configuration: recipe YAML + profile + `--set` overrides -> one frozen, logged Plan.

Imports no torch, so `miles submit` runs on login nodes.
"""

from miles.config.base import ConfigError, Section
from miles.config.plan import Plan
from miles.config.resolve import read_plan, resolve, write_plan

__all__ = ["ConfigError", "Plan", "Section", "read_plan", "resolve", "write_plan"]
