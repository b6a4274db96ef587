"""One choice's generation as the HTTP handlers see it: its events gathered as they arrive, and what
the response says of one choice or of a request's choices (usage, routing, finish reason)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from tokenrouter.server.async_entry import Done, RequestStream, TokenOut


class Generation:
    """The outcome of one choice, gathered as events arrive."""

    def __init__(self, stream: RequestStream, traced: bool = False) -> None:
        self.stream = stream
        self.traced = traced  # the request asked for a per-token trace (routing.trace)
        self.tokens: list[TokenOut] = []
        self.done: Done | None = None
        self.text = ""
        self.start = time.monotonic()
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.gaps: list[float] = []  # seconds between successive tokens' arrivals (inter-token latency)
        self.abandoned = False

    async def events(self, timeout: float | None = None) -> AsyncIterator[TokenOut | Done]:
        """Events until Done; past `timeout` seconds from the start, raise TimeoutError."""
        while self.done is None:
            if timeout is None:
                item = await self.stream.events.get()
            else:
                left = self.start + timeout - time.monotonic()
                item = await asyncio.wait_for(self.stream.events.get(), max(left, 0.0))
            if isinstance(item, TokenOut):
                now = time.monotonic()
                if self.first_token is None:
                    self.first_token = now
                if self.last_token is not None:
                    self.gaps.append(now - self.last_token)
                self.last_token = now
                self.tokens.append(item)
            else:
                self.done = item
            self.text += item.text
            yield item


async def until_timeout(events: AsyncIterator[TokenOut | Done]) -> AsyncIterator[TokenOut | Done | None]:
    """The events, then None if they stopped on the request time limit."""
    try:
        async for item in events:
            yield item
    except TimeoutError:
        yield None


async def merged(streams: list[AsyncIterator[TokenOut | Done]]) -> AsyncIterator[tuple[int, TokenOut | Done | None]]:
    """(index, event) from several choices' event streams as they come, each ending in its Done, or
    None if it stopped on the request time limit."""
    queue: asyncio.Queue[tuple[int, TokenOut | Done | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[TokenOut | Done]) -> None:
        async for item in until_timeout(stream):
            await queue.put((i, item))

    tasks = [asyncio.create_task(pump(i, st)) for i, st in enumerate(streams)]
    try:
        ended = 0
        while ended < len(tasks):
            i, item = await queue.get()
            ended += item is None or isinstance(item, Done)
            yield i, item
    finally:
        for task in tasks:
            task.cancel()


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def usage(gens: list[Generation], n: int) -> dict[str, int]:
    """Usage of a request's choices: each prompt counted once (its n choices share it)."""
    n_prompt = sum(g.stream.prompt_len for g in gens[::n])
    n_out = sum(len(g.tokens) for g in gens)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}


def routing(gen: Generation, writers: bool = False) -> dict[str, Any]:
    """Tokens per model, hand-offs performed (PeerReqs sent) and the routing parameters used; with
    `writers`, the model that wrote each token too; `serving`, what served it, where the server says
    (the default model's SmolLM2 alone while its routed pair is prepared, then the pair)."""
    if gen.done is not None and gen.done.tokens_per_model:
        per_model = gen.done.tokens_per_model
    else:
        per_model = {}
        for t in gen.tokens:
            per_model[t.model] = per_model.get(t.model, 0) + 1
    out: dict[str, Any] = {"tokens_per_model": per_model, "handoffs": gen.done.handoffs if gen.done else 0,
                           "params": (gen.done.routing or {}) if gen.done else {}}
    if writers:
        out["token_models"] = [t.model for t in gen.tokens]
    if gen.stream.serving is not None:
        out["serving"] = gen.stream.serving
    return out


def trace_entries(tokens: list[TokenOut], tokenizer: Any) -> list[dict[str, Any]]:
    """The per-token trace of a traced request's tokens (the choice's `trace` field): each token's id,
    the text released with it, its writer, the models the request passed through just before it
    (`handoff`, ending with the writer; [] for none), the router's score and threshold there, and the
    drafts its writer rejected there (`rejected`, ids, and `rejected_text`; speculative decoding)."""
    out = []
    for t in tokens:
        tr = t.trace
        rejected = list(tr.rejected) if tr is not None else []
        out.append({"token": t.token, "text": t.text, "model": t.model,
                    "handoff": list(tr.path) if tr is not None else [],
                    "score": tr.score if tr is not None else None,
                    "threshold": tr.threshold if tr is not None else None,
                    "rejected": rejected, "rejected_text": tokenizer.decode(rejected) if rejected else ""})
    return out


def total_routing(gens: list[Generation], writers: bool = False) -> dict[str, Any]:
    """A request's routing: its one choice's, or tokens per model and hand-offs summed over its choices."""
    if len(gens) == 1:
        return routing(gens[0], writers)
    per_model: dict[str, int] = {}
    for gen in gens:
        for model, count in routing(gen)["tokens_per_model"].items():
            per_model[model] = per_model.get(model, 0) + count
    out: dict[str, Any] = {"tokens_per_model": per_model,
                           "handoffs": sum(g.done.handoffs if g.done else 0 for g in gens)}
    if gens[0].stream.serving is not None:  # a request's choices are submitted together, to one group
        out["serving"] = gens[0].stream.serving
    return out


def finish_reason(done: Done) -> str:
    return "length" if done.finish_reason == "length" else "stop"
