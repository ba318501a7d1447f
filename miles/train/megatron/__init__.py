"""Megatron-core train backend: HF <-> GPTModel conversion (convert.py, model.py), training (backend.py), export (weights.py), checkpoints, offload."""
