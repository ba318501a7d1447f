"""A light text <-> token-id codec for the engine, read straight from tokenizer.json.

The engine only needs encode (for `text` prompts and /tokenize) and decode (for the reply's `text`
and /detokenize), so it uses the `tokenizers` library directly instead of importing transformers,
which halves start-up time.
"""

from __future__ import annotations

import json
from pathlib import Path


class TextCodec:
    """encode / decode with the model directory's tokenizer.json; `eos_token_id` and
    `model_max_length` (None when not given) from its tokenizer_config.json."""

    def __init__(self, model_dir: str | Path):
        from tokenizers import Tokenizer

        model_dir = Path(model_dir)
        self._tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        cfg_file = model_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
        eos = cfg.get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        self.eos_token_id = self._tok.token_to_id(eos) if eos else None
        self.model_max_length = cfg.get("model_max_length")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


def load_codec(model_dir: str | Path) -> TextCodec | None:
    """The codec, or None when the directory has no tokenizer.json (then only input_ids work)."""
    return TextCodec(model_dir) if (Path(model_dir) / "tokenizer.json").exists() else None
