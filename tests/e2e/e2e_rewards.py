"""A reward used by the end-to-end tests, loaded by dotted path like any user reward."""

from __future__ import annotations

from miles.sample import Sample


def has_digit(sample: Sample) -> float:
    """1.0 when the response contains a digit: dense enough to rise within a few dozen tiny steps."""
    return float(any(ch.isdigit() for ch in sample.response))


def raises(sample: Sample) -> float:
    """A reward function with a bug: the run must stop and say so on the console."""
    raise ValueError("reward function exploded")
