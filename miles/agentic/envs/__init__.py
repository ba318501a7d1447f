"""Environments of agentic episodes: the protocol and registry (base.py), the built-in tool tasks
(calculator, guess) and adapters to outside ecosystems (adapters/)."""

from miles.agentic.envs.base import (
    ENVIRONMENTS,
    Action,
    Environment,
    MalformedCall,
    Observation,
    StepResult,
    ToolCall,
    load_env_class,
    make_env,
)

__all__ = [
    "ENVIRONMENTS",
    "Action",
    "Environment",
    "MalformedCall",
    "Observation",
    "StepResult",
    "ToolCall",
    "load_env_class",
    "make_env",
]
