"""Incremental detokenization never emits a broken multi-byte character."""

from __future__ import annotations

from tokenrouter.engine.tokenizer import IncrementalDetokenizer
from tokenrouter.models.random_model import build_tokenizer


def test_chunks_rebuild_the_text_without_broken_characters():
    tok = build_tokenizer()
    text = "naïve café — 東京 😀 ok"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode())  # byte-level: multi-byte characters span several tokens
    det = IncrementalDetokenizer(tok, prompt_ids=tok.encode("prompt: "))
    chunks = [det.add([i]) for i in ids]
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) == text == det.text
    assert chunks.count("") >= 10  # held back while a character was incomplete


def test_skips_special_tokens():
    tok = build_tokenizer()
    det = IncrementalDetokenizer(tok, prompt_ids=[])
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    out = "".join(det.add([i]) for i in tok.encode("hi") + [eos])
    assert out == "hi"
