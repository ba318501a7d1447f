"""Adapters that bring outside environment ecosystems into Miles: OpenEnv servers (openenv.py) and
Verifiers v1 tasksets (verifiers.py). Each needs its optional extra only where it says so."""
