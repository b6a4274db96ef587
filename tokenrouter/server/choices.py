"""A request's choices on the group: admitted and submitted (each choice its own routed request),
then run to the end or streamed, with the metrics recorded and every choice the client no longer waits
for aborted on the group (a client gone, the time limit, a sibling failed)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from tokenrouter.engine.request_validation import InvalidRequest
from tokenrouter.routing import RoutingParamError
from tokenrouter.sampling_params import SamplingParams
from tokenrouter.server.async_entry import Done, EntryUnavailable, TokenOut
from tokenrouter.server.generation import Generation, finish_reason, merged, routing, sse, usage
from tokenrouter.server.metrics import ServerMetrics
from tokenrouter.server.protocol import APIError, public_message
from tokenrouter.server.runtime_switch import Runtime

logger = logging.getLogger(__name__)


class ChoiceRunner:
    """Owns nothing but references: the group's entry, the server's metrics and its time limit per
    request (seconds; None: none)."""

    def __init__(self, runtime: Runtime, metrics: ServerMetrics, request_timeout: float | None) -> None:
        self.runtime, self.metrics, self.request_timeout = runtime, metrics, request_timeout

    # ---- admission: the request is checked once, by the runtime's rules, into the plan it runs ----
    def submit(self, ids: list[int], params: SamplingParams, routing: dict[str, Any] | None = None) -> Generation:
        try:
            plan = self.runtime.admit(ids, params, routing)
            return Generation(self.runtime.submit(plan), plan.options.trace)
        except InvalidRequest as e:
            raise APIError(400, str(e), param=e.param) from None
        except RoutingParamError as e:
            raise APIError(400, str(e), param=f"routing.{e.field}" if e.field else "routing") from None
        except ValueError as e:
            raise APIError(400, str(e)) from None
        except EntryUnavailable:
            raise APIError(503, "the server cannot take requests: the model group is not serving",
                           type_="service_unavailable") from None

    def submit_choices(self, prompts: list[list[int]], n: int, params: SamplingParams,
                       routing: dict[str, Any] | None) -> list[Generation]:
        """A request's choices, each a routed request of its own: choice i*n + j is prompt i's j-th
        (OpenAI's numbering). As vLLM, choice j of a seeded request samples with seed + j, so the n
        choices differ. If one is refused, those already submitted are aborted."""
        choices = [params if params.seed is None or j == 0 else dataclasses.replace(params, seed=params.seed + j)
                   for j in range(n)]
        gens: list[Generation] = []
        try:
            for ids in prompts:
                gens += [self.submit(ids, choice, routing) for choice in choices]
        except APIError:
            for gen in gens:
                self.runtime.abort(gen.stream.rid)
            raise
        return gens

    def record(self, gen: Generation) -> None:
        assert gen.done is not None
        ttft = None if gen.first_token is None else gen.first_token - gen.start
        self.metrics.finished(gen.done.finish_reason, gen.stream.prompt_len, gen.done.tokens_per_model,
                              gen.done.handoffs, time.monotonic() - gen.start, ttft, gen.gaps)

    def abandon(self, gen: Generation) -> None:
        """The client went away or the time limit passed: abort on the group, count it (once)."""
        if gen.abandoned:
            return
        gen.abandoned = True
        self.runtime.abort(gen.stream.rid)
        self.metrics.requests.labels("abort").inc()

    def timeout_error(self) -> APIError:
        return APIError(408, f"the request ran over the server's {self.request_timeout} s limit",
                        code="request_timeout")

    async def run_to_end(self, request: Request, gens: list[Generation]) -> None:
        """Collect whole generations (a request's choices); abort them all if the client goes away
        first or one of them fails."""
        async def collect(gen: Generation) -> None:
            async for _ in gen.events(self.request_timeout):
                pass

        def stopped(gen: Generation, task: asyncio.Task[None]) -> bool:
            """Failed, or ran over the time limit: the other choices need not run on."""
            return ((gen.done is not None and gen.done.finish_reason == "error")
                    or (task.done() and task.exception() is not None))

        tasks = [asyncio.create_task(collect(g)) for g in gens]
        try:
            while not all(t.done() for t in tasks) and not any(stopped(g, t) for g, t in zip(gens, tasks)):
                await asyncio.wait([t for t in tasks if not t.done()], timeout=0.5,
                                   return_when=asyncio.FIRST_COMPLETED)
                if not all(t.done() for t in tasks) and await request.is_disconnected():
                    raise APIError(499, "client disconnected")
            if any(t.done() and isinstance(t.exception(), TimeoutError) for t in tasks):
                raise self.timeout_error()
        finally:
            for gen, task in zip(gens, tasks):
                if gen.done is None:
                    task.cancel()
                    self.abandon(gen)
        for gen in gens:
            if gen.done is not None:
                self.record(gen)
        for gen in gens:
            if gen.done is not None and gen.done.finish_reason == "error":
                raise self.generation_error(gen.stream.rid, gen.done)

    async def stream_events(self, gens: list[Generation], n: int, chunk: Any, usage_opts: tuple[bool, bool],
                            every_token: bool, writers: bool = False,
                            prefixes: list[str] | None = None) -> AsyncIterator[str]:
        """SSE over a request's choices (choice i is gens[i]): a chunk per token that completes text
        (every token when asked), a chunk with each choice's finish reason, [DONE]. Every token appears in
        exactly one chunk; `prefixes` (echo) open each choice's text. With include_usage a last chunk has
        no choices and the usage; with continuous_usage_stats too, every chunk carries the usage so far."""
        include_usage, continuous = usage_opts

        def counted(obj: dict[str, Any]) -> dict[str, Any]:
            return {**obj, "usage": usage(gens, n)} if continuous else obj

        pending: list[list[TokenOut]] = [[] for _ in gens]  # tokens not yet in a chunk (their text is held back)
        events = merged([g.events(self.request_timeout) for g in gens])
        completed = False
        try:
            for i, prefix in enumerate(prefixes or []):
                yield sse(counted(chunk(i, [], prefix, None)))
            async for i, item in events:
                if item is None:
                    yield sse(self.timeout_error().body())
                    break
                if isinstance(item, TokenOut):
                    pending[i].append(item)
                    if item.text or every_token:
                        yield sse(counted(chunk(i, pending[i], item.text, None)))
                        pending[i] = []
                else:
                    if item.finish_reason == "error":
                        yield sse(self.generation_error(gens[i].stream.rid, item).body())
                        break
                    yield sse(counted({**chunk(i, pending[i], item.text, finish_reason(item)),
                                       "routing": routing(gens[i], writers)}))
            else:
                completed = True
            if completed and include_usage:
                yield sse({**chunk(0, [], "", None), "choices": [], "usage": usage(gens, n)})
            yield "data: [DONE]\n\n"
        finally:
            await events.aclose()
            for gen in gens:
                if gen.done is None:
                    self.abandon(gen)  # the client went away mid-stream, a sibling failed, or the time limit
                else:
                    self.record(gen)

    def generation_error(self, rid: str, done: Done) -> APIError:
        """The error a failed generation answers with; the full message goes to the log only."""
        logger.error("request %s failed: %s", rid, done.error)
        if done.fatal:
            return APIError(503, f"the model group failed or is shutting down (request id {rid}); "
                                 f"{public_message(done.error)}", type_="service_unavailable")
        return APIError(500, f"generation failed (request id {rid}): {public_message(done.error)}",
                        type_="internal_error")
