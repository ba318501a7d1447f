"""Trainer -> engine weight synchronisation: bucketing, transports, versioning, equality check.

`TRANSPORTS` maps `weights.transport` config values to WeightTransport implementations; a run's
transport is `get_transport(plan.weights.transport).from_plan(plan, site)`.
"""

from __future__ import annotations

from miles.weights.bucket import iter_buckets
from miles.weights.check import check_checksums, check_weights, engine_checksums
from miles.weights.disk import DiskTransport
from miles.weights.distributed import DistributedTransport
from miles.weights.lora import LoraTransport
from miles.weights.tensor import TensorTransport
from miles.weights.transport import Bucket, EngineAdmin, Site, WeightTransport

TRANSPORTS: dict[str, type[WeightTransport]] = {
    "disk": DiskTransport,
    "distributed": DistributedTransport,
    "tensor": TensorTransport,
    "lora": LoraTransport,
}


def get_transport(name: str) -> type[WeightTransport]:
    """The transport class for a `weights.transport` value; the error lists the known names."""
    if name not in TRANSPORTS:
        raise KeyError(f"unknown weight transport {name!r}; known: {', '.join(TRANSPORTS)}")
    return TRANSPORTS[name]


__all__ = [
    "TRANSPORTS",
    "Bucket",
    "DiskTransport",
    "DistributedTransport",
    "EngineAdmin",
    "LoraTransport",
    "Site",
    "TensorTransport",
    "WeightTransport",
    "check_checksums",
    "check_weights",
    "engine_checksums",
    "get_transport",
    "iter_buckets",
]
