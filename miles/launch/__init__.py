"""Placing a Plan's processes: on this host (local.py) or as a Slurm job (slurm.py). Imports no torch."""
