"""Models and tokenizers from local directories (never the hub), and tiny models for tests."""

import os
from pathlib import Path


def save_modes(directory: str | Path) -> None:
    """Give every file of a saved model directory the mode this process's umask gives new files.
    transformers writes weight shards through temporary files (mode 600), so an exported model
    would otherwise be readable by its owner alone, unlike the config and tokenizer beside it."""
    umask = os.umask(0)
    os.umask(umask)
    for f in Path(directory).iterdir():
        if f.is_file() and not f.is_symlink():
            os.chmod(f, 0o666 & ~umask)
