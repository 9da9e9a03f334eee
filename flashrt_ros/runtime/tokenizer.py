"""Tokenizers: a byte-level one for the `tiny` preset, and HF `tokenizer.json` through the `tokenizers` library."""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

from .errors import ErrorCode, FlashRTError


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are tokens 0-255; ids >= 256 (end-of-text, discretiser bins) decode to nothing."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    def __init__(self, path: Path):
        from tokenizers import Tokenizer as _Tokenizer

        self._tok = _Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def to_json(self) -> str:
        """The tokenizer.json text (what llguidance builds its tokenizer from)."""
        return self._tok.to_str()


class NoTokenizer:
    """For a checkpoint without tokenizer.json (what ``save_pretrained`` of a bare model gives): ids only."""

    def encode(self, text: str) -> list[int]:
        raise FlashRTError(ErrorCode.INVALID_ARGUMENT, "this model has no tokenizer.json; send token ids, not text")

    def decode(self, ids: list[int]) -> str:
        return ""


def load_tokenizer(folder: Path | None) -> Tokenizer:
    """Presets (folder None) use bytes; a folder uses its tokenizer.json, or runs from token ids without one."""
    if folder is None:
        return ByteTokenizer()
    path = Path(folder) / "tokenizer.json"
    return HFTokenizer(path) if path.is_file() else NoTokenizer()
