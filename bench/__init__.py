"""Benchmarks: timings live here, never in pass/fail tests."""
