"""Miles: Slurm-native reinforcement-learning post-training for large language models."""

import logging

__version__ = "0.1.0"


class _KnownNoise(logging.Filter):
    """Drops two warnings every CPU process printed at start, neither about anything Miles does:
    torchao (imported by transformers when installed) failing to load its CUDA kernels' libraries on a
    host without CUDA, and torch's `_pytree` deprecation notes on torchao's enums."""

    def filter(self, record: logging.LogRecord) -> bool:
        import sys

        text = record.getMessage()
        torch = sys.modules.get("torch")
        no_cuda = torch is not None and not torch.cuda.is_available()
        cuda_library = no_cuda and text.startswith("Failed to load") and ".so" in text
        return not (cuda_library or "is an Enum subclass and is now natively supported" in text)


for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).addFilter(_KnownNoise())
