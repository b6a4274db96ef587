"""What model a subserver serves, told without loading its weights: checked when a subserver started
on another host joins the entry, and when any subserver reports ready (token ids pass between models,
so every model a request may visit must share the entry's vocabulary)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import msgspec

from tokenrouter.engine.tokenizer import load_tokenizer
from tokenrouter.models.config import ModelConfig


def vocab_hash(tokenizer: Any) -> str:
    """A short hash of the token -> id table (added tokens included)."""
    table = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
    return hashlib.sha256(table.encode()).hexdigest()[:16]


class ModelIdentity(msgspec.Struct):
    """The shape of a model (from config.json) and its vocabulary hash."""

    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    vocab_hash: str

    @classmethod
    def from_folder(cls, path: str | Path) -> ModelIdentity:
        mc = ModelConfig.from_folder(path)
        return cls(mc.architecture, mc.num_layers, mc.hidden_size, mc.num_heads, mc.num_kv_heads, mc.vocab_size,
                   vocab_hash(load_tokenizer(path)))

    def differences(self, other: ModelIdentity) -> list[str]:
        """'field: ours != theirs' for every field that differs."""
        mine, theirs = msgspec.structs.asdict(self), msgspec.structs.asdict(other)
        return [f"{k} {mine[k]!r} != {theirs[k]!r}" for k in mine if mine[k] != theirs[k]]
