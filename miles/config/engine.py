"""Settings of the rollout engines: which engine, how many, how big."""

from __future__ import annotations

from typing import Literal

from miles.config.base import Section


class EngineConfig(Section):
    """Rollout engine processes (the embedded engine or SGLang servers)."""

    kind: Literal["embedded", "sglang"] = "embedded"
    """`embedded` is Miles' own engine (CPU or GPU); `sglang` starts real SGLang servers (GPU clusters)."""
    num_engines: int = 1
    """Engine processes on one host (local runs); the sglang-router is put in front when more than one."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device of the embedded engine; `auto` picks cuda when available."""
    max_running_requests: int = 64
    """Requests decoded together in one engine (continuous batching width)."""
    max_total_tokens: int = 65536
    """KV-cache capacity of one engine in tokens."""
    release_memory_in_train: bool = True
    """Colocated + sync schedule: engines free their GPU memory (weights, KV cache, CUDA graphs) while
    the trainer trains and take it back after. Off keeps them resident, which saves the release, the
    resume and the graph captures when engine and trainer fit on the GPUs together."""
    mem_fraction_static: float = 0.5
    """SGLang: fraction of GPU memory for weights and KV cache."""
    tp_size: int = 1
    """SGLang: tensor-parallel size of one server."""
    dp_size: int = 1
    """SGLang: data-parallel replicas inside one server."""
    ep_size: int = 1
    """SGLang: expert-parallel size of one server."""
    router_policy: Literal["cache_aware", "round_robin", "power_of_two", "random", "manual"] = "cache_aware"
    """Policy of the sglang-router; `manual` keeps requests with one `X-SMG-Routing-Key` header on one worker."""
    startup_timeout_s: float = 300.0
    """How long to wait for every engine to report healthy."""
    max_restarts: int = 3
    """Local runs: how often a dead or unhealthy engine is replaced (the loop reloads the current
    weights into it and retries the samples in flight) before the run stops with an error."""
    health_check_interval_s: float = 5.0
    """Local runs: how often the launcher asks each engine's /health; 3 failures in a row and the
    engine is replaced like a dead one."""
    fault_injection: bool = False
    """Testing only: engines serve POST /debug/inject_fault (miles.engine.server) to fake their faults."""
