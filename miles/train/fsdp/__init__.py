"""The FSDP2 train backend: `fully_shard` over a Hugging Face causal LM (see backend.py)."""
