"""The standard-serving baseline's routing loop: for each output position, one backend request to the
small model's plain server (and one to the large model's when the Bernoulli router hands the position
off), the whole context resent each time. standard.py serves it over HTTP; its docstring says why this
is the baseline."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from tokenrouter.engine.stop_strings import find_stop, held_back
from tokenrouter.engine.tokenizer import IncrementalDetokenizer
from tokenrouter.routing.bernoulli import Bernoulli, hands_off
from tokenrouter.server.async_entry import Done, TokenOut

logger = logging.getLogger(__name__)


@dataclass
class StandardConfig:
    small_url: str
    large_url: str
    small_tokenizer: str
    p: float
    model_name: str = "standard"
    small_name: str = "small"  # the writer names in "routing" (as in a routed group's config)
    large_name: str = "large"
    api_key: str | None = None
    backend_timeout: float = 600.0  # seconds one backend request may take
    startup_timeout: float = 120.0  # seconds to wait for the backends at start-up
    max_connections: int = 512


class BackendError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Backend:
    name: str  # writer name reported in "routing"
    url: str
    model: str = ""  # the name the backend answers to
    context_len: int | None = None


@dataclass
class Generation:
    """One request's outcome, in the routed server's event types (TokenOut, Done). A token's
    top_logprobs are keyed by token text here, as the backends return them."""

    rid: str
    prompt_len: int
    tokens: list[TokenOut] = field(default_factory=list)
    done: Done | None = None
    text: str = ""
    backend_requests: int = 0

    def finish(self, reason: str, text: str) -> Done:
        models = [t.model for t in self.tokens]
        per_model: dict[str, int] = {}
        for m in models:
            per_model[m] = per_model.get(m, 0) + 1
        self.done = Done(self.rid, reason, None, text, None, per_model,
                         sum(a != b for a, b in zip(models, models[1:])))
        return self.done

    def routing(self) -> dict[str, Any]:
        assert self.done is not None
        return {"tokens_per_model": self.done.tokens_per_model, "handoffs": self.done.handoffs,
                "token_models": [t.model for t in self.tokens], "backend_requests": self.backend_requests}

    def usage(self) -> dict[str, int]:
        n = len(self.tokens)
        return {"prompt_tokens": self.prompt_len, "completion_tokens": n, "total_tokens": self.prompt_len + n}


class TextStream:
    """Incremental text of one request with stop strings, released as the routed server does."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int], stops: list[str]) -> None:
        self.det = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.stops = stops
        self.final: str | None = None  # the text cut at a stop string
        self.released = 0

    def add(self, token: int) -> bool:
        """Add a token; True when it completes a stop string (the text is then cut before it)."""
        new = self.det.add([token])
        hit = find_stop(self.det.text, len(new), self.stops, include=False) if self.stops else None
        if hit is not None:
            self.final = hit.text
        return hit is not None

    def release(self, done: bool) -> str:
        text = self.final if self.final is not None else self.det.text
        end = max(self.released, len(text) - (0 if done else held_back(self.stops)))
        out, self.released = text[self.released:end], end
        return out


class Coordinator:
    """The routing loop over two plain servers, one token per backend request."""

    def __init__(self, cfg: StandardConfig, tokenizer: Any) -> None:
        Bernoulli([cfg.small_name, cfg.large_name], cfg.p)  # validates p
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.small = Backend(cfg.small_name, cfg.small_url.rstrip("/"))
        self.large = Backend(cfg.large_name, cfg.large_url.rstrip("/"))
        self.client: httpx.AsyncClient | None = None
        self._ready = False

    @property
    def context_len(self) -> int:
        lens = [b.context_len for b in (self.small, self.large) if b.context_len]
        return min(lens) if lens else 0

    async def start(self) -> None:
        limits = httpx.Limits(max_connections=self.cfg.max_connections,
                              max_keepalive_connections=self.cfg.max_connections)
        self.client = httpx.AsyncClient(timeout=self.cfg.backend_timeout, limits=limits)
        deadline = time.monotonic() + self.cfg.startup_timeout
        for b in (self.small, self.large):
            while True:
                try:
                    r = await self.client.get(f"{b.url}/v1/models", timeout=5.0)
                    r.raise_for_status()
                    info = r.json()["data"][0]
                    b.model, b.context_len = info["id"], info.get("max_model_len")
                    break
                except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"backend {b.name} at {b.url} did not answer /v1/models: {e}") from None
                    await asyncio.sleep(0.5)
            logger.info("backend %s: %s (model %r, context %s)", b.name, b.url, b.model, b.context_len)
        self._ready = True

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()

    async def healthy(self) -> bool:
        if not self._ready or self.client is None:
            return False

        async def ok(b: Backend) -> bool:
            try:
                assert self.client is not None
                return (await self.client.get(f"{b.url}/health", timeout=5.0)).status_code == 200
            except httpx.HTTPError:
                return False

        return all(await asyncio.gather(ok(self.small), ok(self.large)))

    def routed(self, seed: int, position: int) -> bool:
        """The Bernoulli router's decision for `position` (= len(prompt + output so far))."""
        return bool(hands_off([seed], [position], self.cfg.p)[0])

    async def one_token(self, b: Backend, context: list[int], sampling: dict[str, Any]) -> tuple[int, str, Any]:
        """Ask backend b for one token after `context`: (token, finish_reason, logprobs or None)."""
        assert self.client is not None
        body = {"model": b.model, "prompt": context, "max_tokens": 1, "return_token_ids": True, **sampling}
        try:
            r = await self.client.post(f"{b.url}/v1/completions", json=body)
        except httpx.HTTPError as e:
            raise BackendError(502, f"backend {b.name}: {type(e).__name__}: {e}") from None
        if r.status_code != 200:
            try:
                msg = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                msg = r.text[:200]
            raise BackendError(r.status_code if r.status_code < 500 else 502, f"backend {b.name}: {msg}")
        choice = r.json()["choices"][0]
        ids = choice.get("token_ids") or []
        if len(ids) != 1:
            raise BackendError(502, f"backend {b.name} returned {len(ids)} tokens for max_tokens=1")
        return ids[0], choice["finish_reason"], choice.get("logprobs")

    async def generate(self, ids: list[int], gen: Generation, max_tokens: int, sampling: dict[str, Any], seed: int,
                       stops: list[str]) -> AsyncIterator[TokenOut | Done]:
        """Yield each token as it is written, then the Done; fills `gen` as it goes."""
        context = list(ids)
        text = TextStream(self.tokenizer, ids, stops)
        backend_sampling = {**sampling, "seed": seed}
        while True:
            position = len(context)
            tok, reason, lp = await self.one_token(self.small, context, backend_sampling)
            gen.backend_requests += 1
            writer = self.small
            if self.routed(seed, position):  # the small token is dropped; the large writes this position
                tok, reason, lp = await self.one_token(self.large, context, backend_sampling)
                gen.backend_requests += 1
                writer = self.large
            context.append(tok)
            stop_hit = text.add(tok)
            finish: str | None = None
            if stop_hit or reason == "stop":  # EOS (unless ignore_eos) or a stop token id
                finish = "stop"
            elif len(gen.tokens) + 1 >= max_tokens or (self.context_len and len(context) >= self.context_len):
                finish = "length"
            item = TokenOut(gen.rid, tok, writer.name, text.release(done=finish is not None),
                            lp["token_logprobs"][0] if lp is not None else None,
                            (lp["top_logprobs"][0] if lp.get("top_logprobs") else {}) if lp is not None else None)
            gen.tokens.append(item)
            gen.text += item.text
            yield item
            if finish is not None:
                done = gen.finish(finish, text.release(done=True))
                gen.text += done.text
                yield done
                return
