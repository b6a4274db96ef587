"""Tokenizer loading and incremental detokenization."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tokenrouter.models.config import ModelLoadError

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str | Path) -> Any:
    """A transformers fast tokenizer from a local folder (never the hub)."""
    folder = Path(path)
    if not any((folder / f).is_file() for f in _TOKENIZER_FILES):
        raise ModelLoadError(f"{str(folder)!r} has no tokenizer files ({', '.join(_TOKENIZER_FILES)})")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text chunks without ever cutting a multi-byte character.

    Decodes a short window (from `prefix_offset`) so each call costs O(new tokens), holds back
    output while the window ends in an incomplete UTF-8 sequence (decoded as U+FFFD), and keeps only
    the window's ids.
    """

    def __init__(self, tokenizer: Any, prompt_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        # Start the window inside the prompt so the first output token decodes with its left context
        # (byte-level and SentencePiece tokenizers render a leading space by context).
        self.ids = list(prompt_ids[-6:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the newly completed text (possibly empty)."""
        self.ids.extend(token_ids)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        full = decode(self.ids[self.prefix_offset:], skip_special_tokens=True)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        new = full[len(prefix):]
        # Keep only the window: ids before it are never decoded again.
        del self.ids[:self.read_offset]
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        self.text += new
        return new
