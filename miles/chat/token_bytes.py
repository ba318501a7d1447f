"""Each token's text and raw bytes, as OpenAI's logprobs show them (`token`, `bytes`).

A token of a byte-level BPE vocabulary (GPT-2, Qwen, Llama 3) can hold part of a UTF-8 character:
decoded alone it reads as U+FFFD, so its text alone cannot give its bytes. Its vocabulary entry can:
byte-level BPE writes each byte as one printable character (GPT-2's `bytes_to_unicode` table), read
back here. SentencePiece byte-fallback tokens (`<0xAB>`) are that byte; any other token's bytes are
the UTF-8 of its decoded text. Joining the bytes of an output's tokens gives the output's UTF-8.
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path
from typing import Any

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte <-> printable-character table, inverted."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _is_byte_level(spec: dict[str, Any]) -> bool:
    decoder = spec.get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return any(p.get("type") == "ByteLevel" for p in parts)


class TokenBytes:
    """Text and bytes of single tokens of one model directory's tokenizer.json (cached per token)."""

    def __init__(self, model_dir: str | Path):
        from tokenizers import Tokenizer

        path = Path(model_dir) / "tokenizer.json"
        self._tok = Tokenizer.from_file(str(path))
        self._byte_level = _is_byte_level(json.loads(path.read_text()))
        self._special = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        """(text of the token decoded alone, special tokens included; its raw bytes)."""
        if token not in self._cache:
            text = self._tok.decode([token], skip_special_tokens=False)
            self._cache[token] = (text, self._bytes(token, text))
        return self._cache[token]

    def _bytes(self, token: int, text: str) -> list[int]:
        piece = self._tok.id_to_token(token)
        if piece is None or token in self._special:
            return list(text.encode())
        table = _byte_decoder()
        if self._byte_level and all(c in table for c in piece):
            return [table[c] for c in piece]
        m = _BYTE_FALLBACK.fullmatch(piece)
        return [int(m.group(1), 16)] if m else list(text.encode())
