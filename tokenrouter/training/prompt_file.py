"""Prompts from a file, as token ids: `tokenrouter calibrate --prompts FILE`.

A `.jsonl` file holds one JSON object per line with `prompt` (a completion prompt, encoded as the
offline API encodes text) or `messages` (a chat: [{"role": ..., "content": ...}], rendered with the
tokenizer's chat template and the server's escaping of special-token text, so a chat is calibrated on
the ids the server would run). Any other file: one completion prompt per non-empty line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenrouter.server.chat import ChatTemplateError, encode_chat, special_token_texts


def _messages(where: str, value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: messages must be a non-empty list of {{role, content}} objects")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: messages[{i}] must be an object with string role and content")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def read_prompts(path: str | Path, tokenizer: Any, limit: int | None = None) -> list[list[int]]:
    """Token ids of every prompt of the file (the first `limit` when given); errors name the line."""
    p = Path(path)
    lines = [(n, line) for n, line in enumerate(p.read_text().splitlines(), 1) if line.strip()]
    if limit is not None:
        lines = lines[:limit]
    if not lines:
        raise ValueError(f"{p}: no prompts")
    if p.suffix != ".jsonl":
        return [list(tokenizer.encode(line)) for _, line in lines]
    specials = special_token_texts(tokenizer)
    prompts = []
    for n, line in lines:
        where = f"{p}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(obj, dict) or ("prompt" in obj) == ("messages" in obj):
            raise ValueError(f"{where}: each line needs exactly one of `prompt` (text) or `messages` (a chat)")
        if "prompt" in obj:
            if not isinstance(obj["prompt"], str) or not obj["prompt"]:
                raise ValueError(f"{where}: prompt must be a non-empty string")
            prompts.append(list(tokenizer.encode(obj["prompt"])))
            continue
        try:
            prompts.append(encode_chat(tokenizer, _messages(where, obj["messages"]), "escape", specials))
        except ChatTemplateError as e:
            raise ValueError(f"{where}: the chat template refused these messages: {e}") from None
    return prompts
