"""Trainer -> engine weight synchronisation: bucketing, transports, versioning, equality check."""
