"""The OpenAI-compatible HTTP API over a routed group (a single model is a group of one)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from tokenrouter.engine.request_validation import InvalidRequest
from tokenrouter.routing import RoutingParamError
from tokenrouter.sampling_params import SamplingParams
from tokenrouter.server.async_entry import AsyncEntry, Done, EntryUnavailable, RequestStream, TokenOut
from tokenrouter.server.chat import ChatTemplateError, SpecialTokens, encode_chat, special_token_texts
from tokenrouter.server.metrics import ServerMetrics
from tokenrouter.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    RequestLimits,
    completion_chunk,
    parse_request,
    validation_message,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = 8 << 20  # a longer body is refused (413) before it is parsed
    request_timeout: float | None = None  # seconds; a request running longer is aborted (408 / error event)
    limits: RequestLimits = field(default_factory=RequestLimits)
    tokenizer_threads: int = 2  # the pool that tokenises prompts, off the event loop
    chat_special_tokens: SpecialTokens = "escape"  # see server/chat.py

    def __post_init__(self) -> None:
        if self.tokenizer_threads < 1:
            raise ValueError(f"tokenizer_threads must be at least 1, got {self.tokenizer_threads}")
        if self.chat_special_tokens not in ("escape", "allow"):
            raise ValueError(f"chat_special_tokens must be 'escape' or 'allow', got {self.chat_special_tokens!r}")


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex[:16]}"


def public_message(error: str | None) -> str:
    """What a client may read of an internal error message: its first line (never a traceback)."""
    lines = (error or "").strip().splitlines()
    return lines[0][:500] if lines else "unknown error"


class _Gen:
    """The outcome of one generation, gathered as events arrive."""

    def __init__(self, stream: RequestStream) -> None:
        self.stream = stream
        self.tokens: list[TokenOut] = []
        self.done: Done | None = None
        self.text = ""
        self.start = time.monotonic()
        self.first_token: float | None = None
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
                if self.first_token is None:
                    self.first_token = time.monotonic()
                self.tokens.append(item)
            else:
                self.done = item
            self.text += item.text
            yield item


async def _until_timeout(events: AsyncIterator[TokenOut | Done]) -> AsyncIterator[TokenOut | Done | None]:
    """The events, then None if they stopped on the request time limit."""
    try:
        async for item in events:
            yield item
    except TimeoutError:
        yield None


def _check_bearer(header: str, api_key: str) -> bool:
    """Whether an Authorization header carries the key; the scheme is case-insensitive (RFC 9110)."""
    scheme, _, token = header.strip().partition(" ")
    ok_scheme = hmac.compare_digest(scheme.lower().encode(), b"bearer")
    return hmac.compare_digest(token.strip().encode(), api_key.encode()) and ok_scheme


class OpenAIServer:
    """The handlers of the HTTP API and what they share: the group, the tokenizer and its thread pool,
    the metrics. build_app wires them into a FastAPI app."""

    def __init__(self, runtime: AsyncEntry, tokenizer: Any, cfg: ServerConfig) -> None:
        self.runtime, self.tokenizer, self.cfg = runtime, tokenizer, cfg
        self.metrics = ServerMetrics()
        # Parsing a large body and tokenising a long prompt take seconds: on the event loop they would
        # stall every endpoint.
        self.pool = ThreadPoolExecutor(cfg.tokenizer_threads, thread_name_prefix="tokenrouter-tokenize")
        self.specials = special_token_texts(tokenizer)
        self.token_text = functools.lru_cache(maxsize=65536)(lambda tok: tokenizer.decode([tok]))
        if getattr(tokenizer, "chat_template", None) is None:
            logger.warning("the tokenizer has no chat template; chat requests use ChatML")

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.runtime.close()

    # ---- errors ------------------------------------------------------------------------------
    def api_error(self, exc: APIError, request_id: str | None = None) -> JSONResponse:
        self.metrics.rejected.labels(str(exc.status)).inc()
        headers = {"x-request-id": request_id} if request_id else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    async def on_api_error(self, request: Request, exc: APIError) -> JSONResponse:
        return self.api_error(exc)

    async def on_http_error(self, request: Request, exc: HTTPException) -> JSONResponse:
        """404, 405, ... in the OpenAI shape instead of FastAPI's {"detail": ...}."""
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return self.api_error(APIError(exc.status_code, str(exc.detail), type_=kind))

    async def on_validation_error(self, request: Request, exc: RequestValidationError) -> JSONResponse:
        msg, param = validation_message(exc)
        return self.api_error(APIError(400, msg, param=param))

    async def on_internal_error(self, request: Request, exc: Exception) -> JSONResponse:
        """A bug: the client gets a request id and no internals; the log gets the traceback."""
        request_id = new_request_id()
        logger.error("request %s (%s %s) failed", request_id, request.method, request.url.path, exc_info=exc)
        return self.api_error(APIError(500, f"internal server error (request id {request_id}); the server "
                                            "log has the details", type_="internal_error"), request_id)

    def generation_error(self, rid: str, done: Done) -> APIError:
        """The error a failed generation answers with; the full message goes to the log only."""
        logger.error("request %s failed: %s", rid, done.error)
        if done.fatal:
            return APIError(503, f"the model group failed or is shutting down (request id {rid}); "
                                 f"{public_message(done.error)}", type_="service_unavailable")
        return APIError(500, f"generation failed (request id {rid}): {public_message(done.error)}",
                        type_="internal_error")

    # ---- shared steps ------------------------------------------------------------------------
    def check_auth(self, request: Request) -> None:
        key = self.cfg.api_key
        if key is not None and not _check_bearer(request.headers.get("authorization", ""), key):
            raise APIError(401, "invalid API key", type_="authentication_error", code="invalid_api_key")

    async def parse(self, request: Request, model: type[pydantic.BaseModel]) -> Any:
        limit = self.cfg.max_body_bytes
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > limit:
                raise APIError(413, f"the request body is over {limit} bytes", code="body_too_large")
        # Parsing and validating up to max_body_bytes of JSON takes long enough to stall the loop.
        return await self.off_loop(lambda: parse_request(body, model, self.cfg.model_name, self.cfg.limits))

    async def off_loop(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn)

    def context_len(self) -> int:
        assert self.runtime.entry is not None
        return self.runtime.entry.context_len

    # ---- admission: the request is checked once, by the runtime's rules, into the plan it runs ----
    def submit(self, ids: list[int], max_tokens: int | None, sampling: Callable[[int], SamplingParams],
               routing: dict[str, Any] | None = None) -> _Gen:
        try:
            return _Gen(self.runtime.submit(self.runtime.admit(ids, max_tokens, sampling, routing)))
        except InvalidRequest as e:
            raise APIError(400, str(e), param=e.param) from None
        except RoutingParamError as e:
            raise APIError(400, str(e), param=f"routing.{e.field}" if e.field else "routing") from None
        except ValueError as e:
            raise APIError(400, str(e)) from None
        except EntryUnavailable:
            raise APIError(503, "the server cannot take requests: the model group is not serving",
                           type_="service_unavailable") from None

    def record(self, gen: _Gen) -> None:
        assert gen.done is not None
        m = self.metrics
        m.finished(gen.done.finish_reason, gen.stream.prompt_len, gen.done.tokens_per_model, gen.done.handoffs)
        m.e2e.observe(time.monotonic() - gen.start)
        if gen.first_token is not None:
            m.ttft.observe(gen.first_token - gen.start)

    def abandon(self, gen: _Gen) -> None:
        """The client went away or the time limit passed: abort on the group, count it (once)."""
        if gen.abandoned:
            return
        gen.abandoned = True
        self.runtime.abort(gen.stream.rid)
        self.metrics.requests.labels("abort").inc()

    def timeout_error(self) -> APIError:
        return APIError(408, f"the request ran over the server's {self.cfg.request_timeout} s limit",
                        code="request_timeout")

    async def run_to_end(self, request: Request, gen: _Gen) -> None:
        """Collect a whole generation; abort it if the client goes away first."""
        async def collect() -> None:
            async for _ in gen.events(self.cfg.request_timeout):
                pass

        task = asyncio.create_task(collect())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=0.5)
                if not task.done() and await request.is_disconnected():
                    task.cancel()
                    self.abandon(gen)
                    raise APIError(499, "client disconnected")
            if isinstance(task.exception(), TimeoutError):
                self.abandon(gen)
                raise self.timeout_error()
        finally:
            if not task.done():
                task.cancel()
                self.abandon(gen)
        self.record(gen)
        if gen.done is not None and gen.done.finish_reason == "error":
            raise self.generation_error(gen.stream.rid, gen.done)

    async def stream_events(self, gen: _Gen, chunk: Any, include_usage: bool, every_token: bool,
                            writers: bool = False) -> AsyncIterator[str]:
        """SSE: a chunk per token that completes text (every token when asked), a final chunk with the
        finish reason, [DONE]. Every token appears in exactly one chunk."""
        pending: list[TokenOut] = []  # tokens not yet in a chunk (their text is held back)
        try:
            async for item in _until_timeout(gen.events(self.cfg.request_timeout)):
                if item is None:
                    yield sse(self.timeout_error().body())
                    break
                if isinstance(item, TokenOut):
                    pending.append(item)
                    if item.text or every_token:
                        yield sse(chunk(pending, item.text, None))
                        pending = []
                else:
                    if item.finish_reason == "error":
                        yield sse(self.generation_error(gen.stream.rid, item).body())
                        break
                    yield sse({**chunk(pending, item.text, finish_reason(item)), "routing": routing(gen, writers)})
                    if include_usage:
                        yield sse({**chunk([], "", None), "choices": [], "usage": usage(gen)})
            yield "data: [DONE]\n\n"
        finally:
            if gen.done is None:
                self.abandon(gen)  # the client went away mid-stream, or the time limit passed
            else:
                self.record(gen)

    def completion_logprobs(self, toks: list[TokenOut], offset: int) -> dict[str, Any]:
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t in toks:
            out["tokens"].append(self.token_text(t.token))
            out["token_logprobs"].append(t.logprob)
            out["top_logprobs"].append({self.token_text(k): v for k, v in (t.top_logprobs or {}).items()})
            out["text_offset"].append(offset)
            offset += len(t.text)
        return out

    def chat_logprobs(self, toks: list[TokenOut]) -> dict[str, Any]:
        def entry(tok: int, lp: float | None) -> dict[str, Any]:
            s = self.token_text(tok)
            return {"token": s, "logprob": lp, "bytes": list(s.encode())}

        return {"content": [
            {**entry(t.token, t.logprob),
             "top_logprobs": [entry(k, v) for k, v in (t.top_logprobs or {}).items()]}
            for t in toks]}

    # ---- endpoints ---------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        self.check_auth(request)
        body: CompletionRequest = await self.parse(request, CompletionRequest)
        prompt = body.single_prompt(self.cfg.limits)
        if isinstance(prompt, str):
            ids = await self.off_loop(lambda: list(self.tokenizer.encode(prompt)))
        else:
            ids = list(prompt)
        gen = self.submit(ids, body.max_tokens, lambda cap: body.sampling(cap, body.logprobs), body.routing)
        rid, created = gen.stream.rid, int(time.time())
        want_lp = body.logprobs is not None
        model_name = self.cfg.model_name

        def chunk(toks: list[TokenOut], text: str, reason: str | None) -> dict[str, Any]:
            return completion_chunk(rid, created, model_name, text, reason,
                                    self.completion_logprobs(toks, 0) if want_lp else None,
                                    [t.token for t in toks] if body.return_token_ids else None)

        if body.stream:
            include = bool(body.stream_options and body.stream_options.include_usage)
            every = want_lp or body.return_token_ids
            return StreamingResponse(self.stream_events(gen, chunk, include, every, body.return_token_ids),
                                     media_type="text/event-stream")
        await self.run_to_end(request, gen)
        assert gen.done is not None
        out = chunk(gen.tokens, gen.text, finish_reason(gen.done))
        return JSONResponse({**out, "usage": usage(gen), "routing": routing(gen, body.return_token_ids)})

    async def chat_completions(self, request: Request) -> Response:
        self.check_auth(request)
        body: ChatCompletionRequest = await self.parse(request, ChatCompletionRequest)
        messages = body.texts(self.cfg.limits)
        try:
            ids = await self.off_loop(lambda: encode_chat(self.tokenizer, messages, self.cfg.chat_special_tokens,
                                                          self.specials))
        except ChatTemplateError as e:
            raise APIError(400, f"the chat template rejected the messages: {public_message(str(e))}",
                           param="messages") from None
        logprobs = body.requested_logprobs()
        gen = self.submit(ids, body.max_completion_tokens or body.max_tokens, lambda cap: body.sampling(cap, logprobs),
                          body.routing)
        rid, created = "chat" + gen.stream.rid, int(time.time())
        first = [True]
        model_name = self.cfg.model_name

        def chunk(toks: list[TokenOut], text: str, reason: str | None) -> dict[str, Any]:
            delta: dict[str, Any] = {"content": text} if text or reason is None else {}
            if first[0]:
                delta = {"role": "assistant", **delta}
                first[0] = False
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": reason,
                                 "logprobs": self.chat_logprobs(toks) if logprobs is not None else None}]}

        if body.stream:
            include = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self.stream_events(gen, chunk, include, logprobs is not None),
                                     media_type="text/event-stream")
        await self.run_to_end(request, gen)
        assert gen.done is not None
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": created, "model": model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": gen.text},
                         "finish_reason": finish_reason(gen.done),
                         "logprobs": self.chat_logprobs(gen.tokens) if logprobs is not None else None}],
            "usage": usage(gen), "routing": routing(gen)})

    async def models(self, request: Request) -> Response:
        self.check_auth(request)
        return JSONResponse({"object": "list", "data": [{
            "id": self.cfg.model_name, "object": "model", "created": 0, "owned_by": "tokenrouter",
            "max_model_len": self.context_len() if self.runtime.entry else None,
            "members": self.runtime.group.names}]})

    async def health(self) -> Response:
        if self.runtime.healthy:
            return JSONResponse({"status": "ok"})
        # Unauthenticated: the cause goes to the log, not here.
        return JSONResponse({"status": "unavailable", "error": "the model group is not serving"}, status_code=503)

    async def metrics_endpoint(self, request: Request) -> Response:
        self.check_auth(request)
        stats = await self.runtime.stats() if self.runtime.healthy else {}
        waiting, running = self.runtime.queue_lengths()
        return Response(self.metrics.render(stats, waiting, running), media_type="text/plain; version=0.0.4")


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def usage(gen: _Gen) -> dict[str, int]:
    n_out = len(gen.tokens)
    return {"prompt_tokens": gen.stream.prompt_len, "completion_tokens": n_out,
            "total_tokens": gen.stream.prompt_len + n_out}


def routing(gen: _Gen, writers: bool = False) -> dict[str, Any]:
    """Tokens per model, hand-offs performed (PeerReqs sent) and the routing parameters used; with
    `writers`, the model that wrote each token too."""
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
    return out


def finish_reason(done: Done) -> str:
    return "length" if done.finish_reason == "length" else "stop"


def build_app(runtime: AsyncEntry, tokenizer: Any, cfg: ServerConfig) -> FastAPI:
    server = OpenAIServer(runtime, tokenizer, cfg)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        server.close()

    # With an API key the schema and its viewers are closed too (they list every endpoint and field);
    # in-process callers still have app.openapi().
    closed: dict[str, Any] = {"docs_url": None, "redoc_url": None, "openapi_url": None} if cfg.api_key else {}
    app = FastAPI(title="tokenrouter", lifespan=lifespan, **closed)
    app.add_exception_handler(APIError, server.on_api_error)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, server.on_http_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, server.on_validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, server.on_internal_error)
    app.add_api_route("/v1/completions", server.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", server.chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", server.models, methods=["GET"])
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/metrics", server.metrics_endpoint, methods=["GET"])
    return app
