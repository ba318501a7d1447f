"""A light text <-> token-id codec for the engine, read straight from tokenizer.json.

The engine only needs encode (for `text` prompts) and decode (for the reply's `text`), so it uses
the `tokenizers` library directly instead of importing transformers, which halves start-up time.
"""

from __future__ import annotations

import json
from pathlib import Path


class TextCodec:
    """encode / decode with the model directory's tokenizer.json; `eos_token_id` from its config."""

    def __init__(self, model_dir: str | Path):
        from tokenizers import Tokenizer

        model_dir = Path(model_dir)
        self._tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        cfg_file = model_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
        eos = cfg.get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        self.eos_token_id = self._tok.token_to_id(eos) if eos else None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


def load_codec(model_dir: str | Path) -> TextCodec | None:
    """The codec, or None when the directory has no tokenizer.json (then only input_ids work)."""
    return TextCodec(model_dir) if (Path(model_dir) / "tokenizer.json").exists() else None
