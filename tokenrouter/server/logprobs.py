"""Logprobs in the OpenAI response shapes: /v1/completions' (with an echoed prompt's) and chat's. Token
texts are decoded one token at a time, cached."""

from __future__ import annotations

import functools
from typing import Any

from tokenrouter.server.async_entry import TokenOut


class LogprobFormat:
    def __init__(self, tokenizer: Any) -> None:
        self.token_text = functools.lru_cache(maxsize=65536)(lambda tok: tokenizer.decode([tok]))

    def completion(self, toks: list[TokenOut], offset: int) -> dict[str, Any]:
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t in toks:
            out["tokens"].append(self.token_text(t.token))
            out["token_logprobs"].append(t.logprob)
            out["top_logprobs"].append({self.token_text(k): v for k, v in (t.top_logprobs or {}).items()})
            out["text_offset"].append(offset)
            offset += len(t.text)
        return out

    def prompt(self, prompt: list[int], values: tuple[list[float], list[dict[int, float]]] | None,
                        ) -> dict[str, list[Any]]:
        """OpenAI's logprobs of an echoed prompt: the first token has none (null), each other its logprob
        and top logprobs; offsets count from the prompt's start. `values`: None when no token came."""
        lps, tops = values if values is not None else ([], [])
        texts = [self.token_text(t) for t in prompt]
        offsets = [0]
        for piece in texts[:-1]:
            offsets.append(offsets[-1] + len(piece))
        return {"tokens": texts, "token_logprobs": [None, *lps][:len(prompt)],
                "top_logprobs": [None, *({self.token_text(k): v for k, v in t.items()} for t in tops)][:len(prompt)],
                "text_offset": offsets}

    def chat(self, toks: list[TokenOut]) -> dict[str, Any]:
        def entry(tok: int, lp: float | None) -> dict[str, Any]:
            s = self.token_text(tok)
            return {"token": s, "logprob": lp, "bytes": list(s.encode())}

        return {"content": [
            {**entry(t.token, t.logprob),
             "top_logprobs": [entry(k, v) for k, v in (t.top_logprobs or {}).items()]}
            for t in toks]}
