"""The bytes a single token stands for, as OpenAI's logprobs give them (`bytes`).

Decoding one token alone cannot give them: a token holding part of a character (an emoji or
a CJK character is often two or three byte tokens) decodes to U+FFFD, so a client joining
the `bytes` of an answer's tokens would rebuild "���" where the text has "🦙". The bytes
are read from the token's own spelling in the vocabulary instead:

- byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2): every byte is spelt as one printable
  character (GPT-2's `bytes_to_unicode` table); the token's characters map back to bytes.
- SentencePiece with byte fallback (Llama 2, Mistral, Gemma): "▁" is a space, `<0xE2>` is
  the byte 0xE2, anything else is its UTF-8.

Added tokens (`<|im_end|>`) are their text. A tokenizer of neither kind (or a slow one)
gives None: the caller falls back to the token decoded alone.
"""

from __future__ import annotations

import json
import re
from typing import Any

_SENTENCEPIECE_SPACE = "\u2581"
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's spelling of bytes, reversed (character -> byte): printable Latin-1 bytes stand
    for themselves, the other 68 for the characters from U+0100 on, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    spelling = {byte: byte for byte in printable}
    for byte in range(256):
        if byte not in spelling:
            spelling[byte] = 0x100 + len(spelling) - len(printable)
    return {chr(char): byte for byte, char in spelling.items()}


class TokenBytes:
    """token id -> its bytes, or None where the tokenizer's kind is not known here."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        kinds = _decoder_kinds(tokenizer)
        self._byte_level = byte_level_alphabet() if "ByteLevel" in kinds else None
        self._byte_fallback = "ByteFallback" in kinds
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self._added = {token_id: token.content for token_id, token in added.items()}

    def is_added(self, token_id: int) -> bool:
        """An added token (`<s>`, `<|im_end|>`): one the tokenizer may put in by itself."""
        return token_id in self._added

    def __call__(self, token_id: int) -> bytes | None:
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        if self._byte_level is None and not self._byte_fallback:
            return None
        spelling = self._tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(spelling, str):
            return None
        if self._byte_level is not None:
            alphabet = self._byte_level
            if all(char in alphabet for char in spelling):
                return bytes(alphabet[char] for char in spelling)
            return spelling.encode("utf-8")
        byte = _BYTE_TOKEN.fullmatch(spelling)
        if byte is not None:
            return bytes([int(byte.group(1), 16)])
        return spelling.replace(_SENTENCEPIECE_SPACE, " ").encode("utf-8")


def _decoder_kinds(tokenizer: Any) -> set[str]:
    """The `type`s in the fast tokenizer's decoder (a Sequence nests its steps), read from
    the decoder's own JSON (not the whole tokenizer's, megabytes with its vocabulary)."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None:
        return set()
    kinds: set[str] = set()
    pending = [json.loads(decoder.__getstate__())]
    while pending:
        step = pending.pop()
        if isinstance(step, dict):
            kinds.add(str(step.get("type")))
            pending.extend(step.get("decoders") or [])
    return kinds
