"""The OpenAI-compatible HTTP API over a routed group (a single model is a group of one)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenrouter import __version__
from tokenrouter.sampling_params import SamplingParams
from tokenrouter.server.async_entry import AsyncEntry, Done, EntryUnavailable, RequestStream, TokenOut
from tokenrouter.server.metrics import ServerMetrics
from tokenrouter.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    completion_chunk,
    parse_request,
    parse_tool_request,
)

logger = logging.getLogger(__name__)

# ChatML, for tokenizers that ship no chat template.
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chat_prompt(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """The prompt text of a chat: the tokenizer's chat template, or ChatML when it has none, with the
    assistant's turn opened (unless asked not to)."""
    template = getattr(tokenizer, "chat_template", None) or DEFAULT_CHAT_TEMPLATE
    return str(tokenizer.apply_chat_template(messages, chat_template=template,
                                             add_generation_prompt=add_generation_prompt, tokenize=False))


@dataclass
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = 8 << 20  # a longer body is refused (413) before it is parsed
    request_timeout: float | None = None  # seconds; a request running longer is aborted (408 / error event)


class _Gen:
    """The outcome of one generation, gathered as events arrive."""

    def __init__(self, stream: RequestStream) -> None:
        self.stream = stream
        self.tokens: list[TokenOut] = []
        self.done: Done | None = None
        self.text = ""
        self.start = time.monotonic()
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.gaps: list[float] = []  # seconds between successive tokens' arrivals (inter-token latency)

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


async def _until_timeout(events: AsyncIterator[TokenOut | Done]) -> AsyncIterator[TokenOut | Done | None]:
    """The events, then None if they stopped on the request time limit."""
    try:
        async for item in events:
            yield item
    except TimeoutError:
        yield None


async def _merged(streams: list[AsyncIterator[TokenOut | Done]]) -> AsyncIterator[tuple[int, TokenOut | Done | None]]:
    """(index, event) from several choices' event streams as they come, each ending in its Done, or
    None if it stopped on the request time limit."""
    queue: asyncio.Queue[tuple[int, TokenOut | Done | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[TokenOut | Done]) -> None:
        async for item in _until_timeout(stream):
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


def build_app(runtime: AsyncEntry, tokenizer: Any, cfg: ServerConfig) -> FastAPI:
    metrics = ServerMetrics(cfg.model_name)
    if getattr(tokenizer, "chat_template", None) is None:
        logger.warning("the tokenizer has no chat template; chat requests use ChatML")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        runtime.close()

    # With an API key the schema and its viewers are closed too (they list every endpoint and field);
    # in-process callers still have app.openapi().
    closed: dict[str, Any] = {"docs_url": None, "redoc_url": None, "openapi_url": None} if cfg.api_key else {}
    app = FastAPI(title="tokenrouter", lifespan=lifespan, **closed)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        metrics.rejected.labels(str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status)

    def check_auth(request: Request) -> None:
        if cfg.api_key is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, f"Bearer {cfg.api_key}".encode()):
            raise APIError(401, "invalid API key", type_="authentication_error", code="invalid_api_key")

    async def parse(request: Request, model: type[pydantic.BaseModel]) -> Any:
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > cfg.max_body_bytes:
                raise APIError(413, f"the request body is over {cfg.max_body_bytes} bytes", code="body_too_large")
        return parse_request(body, model, cfg.model_name)

    def context_len() -> int:
        assert runtime.entry is not None
        return runtime.entry.context_len

    def plan_tokens(n_prompt: int, max_tokens: int | None) -> int:
        ctx = context_len()
        if n_prompt == 0:
            raise APIError(400, "the prompt is empty", param="prompt")
        if max_tokens is None:
            max_tokens = ctx - n_prompt
        if max_tokens < 1:
            raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
        if n_prompt + max_tokens > ctx:
            raise APIError(400, f"This model's maximum context length is {ctx} tokens. However, you requested "
                                f"{n_prompt + max_tokens} tokens ({n_prompt} in the prompt, {max_tokens} in the "
                                "completion). Please reduce the length of the prompt or completion.",
                           param="max_tokens")
        return max_tokens

    def submit(ids: list[int], params: Any) -> _Gen:
        try:
            return _Gen(runtime.submit(ids, params))
        except ValueError as e:
            raise APIError(400, str(e)) from None
        except EntryUnavailable as e:
            raise APIError(503, f"the server cannot take requests: {e}", type_="service_unavailable") from None

    @functools.lru_cache(maxsize=65536)
    def token_text(tok: int) -> str:
        return tokenizer.decode([tok])

    def record(gen: _Gen) -> None:
        assert gen.done is not None
        ttft = None if gen.first_token is None else gen.first_token - gen.start
        metrics.finished(gen.done.finish_reason, gen.stream.prompt_len, gen.done.tokens_per_model, gen.done.handoffs,
                         time.monotonic() - gen.start, ttft, gen.gaps)

    async def run_to_end(request: Request, gens: list[_Gen]) -> None:
        """Collect whole generations (a request's choices); abort them all if the client goes away first
        or one of them fails."""
        async def collect(gen: _Gen) -> None:
            async for _ in gen.events(cfg.request_timeout):
                pass

        def stopped(gen: _Gen, task: asyncio.Task[None]) -> bool:
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
                raise APIError(408, f"the request ran over the server's {cfg.request_timeout} s limit",
                               code="request_timeout")
        finally:
            for gen, task in zip(gens, tasks):
                if gen.done is None:
                    task.cancel()
                    runtime.abort(gen.stream.rid)
        for gen in gens:
            if gen.done is not None:
                record(gen)
        for gen in gens:
            if gen.done is not None and gen.done.finish_reason == "error":
                if gen.done.fatal:
                    raise APIError(503, str(gen.done.error), type_="service_unavailable")
                raise APIError(500, f"generation failed: {gen.done.error}", type_="internal_error")

    def usage(gens: list[_Gen], n: int) -> dict[str, int]:
        """Usage of a request's choices: each prompt counted once (its n choices share it)."""
        n_prompt = sum(g.stream.prompt_len for g in gens[::n])
        n_out = sum(len(g.tokens) for g in gens)
        return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}

    def routing(gen: _Gen, writers: bool = False) -> dict[str, Any]:
        """Tokens per model and hand-offs; with `writers`, the model that wrote each token too."""
        if gen.done is not None and gen.done.tokens_per_model:
            per_model = gen.done.tokens_per_model
        else:
            per_model = {}
            for t in gen.tokens:
                per_model[t.model] = per_model.get(t.model, 0) + 1
        out: dict[str, Any] = {"tokens_per_model": per_model, "handoffs": gen.done.handoffs if gen.done else 0}
        if writers:
            out["token_models"] = [t.model for t in gen.tokens]
        return out

    def total_routing(gens: list[_Gen]) -> dict[str, Any]:
        """Tokens per model and hand-offs summed over a request's choices."""
        per_model: dict[str, int] = {}
        for gen in gens:
            for model, count in routing(gen)["tokens_per_model"].items():
                per_model[model] = per_model.get(model, 0) + count
        return {"tokens_per_model": per_model, "handoffs": sum(g.done.handoffs if g.done else 0 for g in gens)}

    def finish_reason(done: Done) -> str:
        return "length" if done.finish_reason == "length" else "stop"

    def completion_logprobs(toks: list[TokenOut], offset: int) -> dict[str, Any]:
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t in toks:
            out["tokens"].append(token_text(t.token))
            out["token_logprobs"].append(t.logprob)
            out["top_logprobs"].append({token_text(k): v for k, v in (t.top_logprobs or {}).items()})
            out["text_offset"].append(offset)
            offset += len(t.text)
        return out

    def chat_logprobs(toks: list[TokenOut]) -> dict[str, Any]:
        def entry(tok: int, lp: float | None) -> dict[str, Any]:
            s = token_text(tok)
            return {"token": s, "logprob": lp, "bytes": list(s.encode())}

        return {"content": [
            {**entry(t.token, t.logprob),
             "top_logprobs": [entry(k, v) for k, v in (t.top_logprobs or {}).items()]}
            for t in toks]}

    def sse(obj: Any) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    async def stream_events(request: Request, gens: list[_Gen], n: int, chunk: Any, usage_opts: tuple[bool, bool],
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
        events = _merged([g.events(cfg.request_timeout) for g in gens])
        completed = False
        try:
            for i, prefix in enumerate(prefixes or []):
                yield sse(counted(chunk(i, [], prefix, None)))
            async for i, item in events:
                if item is None:
                    yield sse(APIError(408, f"the request ran over the server's {cfg.request_timeout} s limit",
                                       code="request_timeout").body())
                    break
                if isinstance(item, TokenOut):
                    pending[i].append(item)
                    if item.text or every_token:
                        yield sse(counted(chunk(i, pending[i], item.text, None)))
                        pending[i] = []
                else:
                    if item.finish_reason == "error":
                        status, kind = (503, "service_unavailable") if item.fatal else (500, "internal_error")
                        yield sse(APIError(status, f"generation failed: {item.error}", type_=kind).body())
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
                    runtime.abort(gen.stream.rid)  # the client went away mid-stream, or a sibling failed
                else:
                    record(gen)

    def submit_all(plans: list[tuple[list[int], SamplingParams]]) -> list[_Gen]:
        """Submit a request's choices; if one is refused, abort those already submitted."""
        gens: list[_Gen] = []
        try:
            for ids, params in plans:
                gens.append(submit(ids, params))
        except APIError:
            for gen in gens:
                runtime.abort(gen.stream.rid)
            raise
        return gens

    def choice_params(params: SamplingParams, j: int) -> SamplingParams:
        # As vLLM: choice j of a seeded request samples with seed + j, so the n choices differ.
        return params if params.seed is None or j == 0 else dataclasses.replace(params, seed=params.seed + j)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        check_auth(request)
        body: CompletionRequest = await parse(request, CompletionRequest)
        n = body.n
        prompts = body.prompts()
        encoded = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        plans = []
        for ids in encoded:
            params = body.sampling(plan_tokens(len(ids), body.max_tokens), body.logprobs)
            plans += [(ids, choice_params(params, j)) for j in range(n)]
        gens = submit_all(plans)  # choice i*n + j: prompt i, its j-th choice (OpenAI's numbering)
        rid, created = gens[0].stream.rid, int(time.time())
        want_lp = body.logprobs is not None
        # echo: each choice's text opens with its prompt's text
        echoed = [p if isinstance(p, str) else tokenizer.decode(p) for p in prompts for _ in range(n)] \
            if body.echo else None

        def chunk(i: int, toks: list[TokenOut], text: str, reason: str | None) -> dict[str, Any]:
            return completion_chunk(rid, created, cfg.model_name, i, text, reason,
                                    completion_logprobs(toks, 0) if want_lp else None,
                                    [t.token for t in toks] if body.return_token_ids else None)

        if body.stream:
            every = want_lp or body.return_token_ids
            return StreamingResponse(stream_events(request, gens, n, chunk, body.usage_options(), every,
                                                   body.return_token_ids, echoed),
                                     media_type="text/event-stream")
        await run_to_end(request, gens)
        choices = []
        for i, gen in enumerate(gens):
            assert gen.done is not None
            text = (echoed[i] if echoed else "") + gen.text
            choices.append({**chunk(i, gen.tokens, text, finish_reason(gen.done))["choices"][0],
                            "routing": routing(gen, body.return_token_ids)})
        out = {**chunk(0, [], "", None), "choices": choices, "usage": usage(gens, n)}
        return JSONResponse({**out, "routing": choices[0]["routing"] if len(gens) == 1 else total_routing(gens)})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        check_auth(request)
        body: ChatCompletionRequest = await parse(request, ChatCompletionRequest)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            text = chat_prompt(tokenizer, messages)
        except Exception as e:  # noqa: BLE001 - a template that rejects these messages
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
        ids = tokenizer.encode(text, add_special_tokens=False)
        logprobs = body.requested_logprobs()
        params = body.sampling(plan_tokens(len(ids), body.max_completion_tokens or body.max_tokens), logprobs)
        gens = submit_all([(ids, choice_params(params, j)) for j in range(body.n)])
        rid, created = "chat" + gens[0].stream.rid, int(time.time())
        first = [True] * len(gens)

        def chunk(i: int, toks: list[TokenOut], text: str, reason: str | None) -> dict[str, Any]:
            delta: dict[str, Any] = {"content": text} if text or reason is None else {}
            if first[i]:
                delta = {"role": "assistant", **delta}
                first[i] = False
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": cfg.model_name,
                    "choices": [{"index": i, "delta": delta, "finish_reason": reason,
                                 "logprobs": chat_logprobs(toks) if logprobs is not None else None}]}

        if body.stream:
            return StreamingResponse(stream_events(request, gens, body.n, chunk, body.usage_options(),
                                                   logprobs is not None),
                                     media_type="text/event-stream")
        await run_to_end(request, gens)
        choices = []
        for i, gen in enumerate(gens):
            assert gen.done is not None
            choices.append({"index": i, "message": {"role": "assistant", "content": gen.text},
                            "finish_reason": finish_reason(gen.done),
                            "logprobs": chat_logprobs(gen.tokens) if logprobs is not None else None,
                            "routing": routing(gen)})
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": created, "model": cfg.model_name,
            "choices": choices, "usage": usage(gens, body.n),
            "routing": choices[0]["routing"] if len(gens) == 1 else total_routing(gens)})

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        check_auth(request)
        return JSONResponse({"object": "list", "data": [{
            "id": cfg.model_name, "object": "model", "created": 0, "owned_by": "tokenrouter",
            "max_model_len": context_len() if runtime.entry else None,
            "members": runtime.group.names}]})

    @app.get("/health")
    async def health() -> Response:
        if runtime.healthy:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable", "error": str(runtime.error or "")}, status_code=503)

    @app.get("/metrics")
    async def metrics_endpoint(request: Request) -> Response:
        check_auth(request)
        stats = await runtime.stats() if runtime.healthy else {}
        waiting, running = runtime.queue_lengths()
        return Response(metrics.render(stats, waiting, running), media_type="text/plain; version=0.0.4")

    # ---- the endpoints vLLM users script against ----------------------------------------------
    async def read_body(request: Request) -> bytes:
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > cfg.max_body_bytes:
                raise APIError(413, f"the request body is over {cfg.max_body_bytes} bytes", code="body_too_large")
        return bytes(body)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        check_auth(request)
        body: TokenizeRequest = parse_tool_request(await read_body(request), TokenizeRequest, cfg.model_name)
        body.check()
        if body.messages is not None:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            try:
                text = chat_prompt(tokenizer, messages, body.add_generation_prompt)
            except Exception as e:  # noqa: BLE001 - a template that rejects these messages
                raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
            ids = tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))
        else:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = tokenizer.encode(body.prompt, add_special_tokens=special)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": context_len() if runtime.entry else None,
                               "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
        return JSONResponse(out)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        check_auth(request)
        body: DetokenizeRequest = parse_tool_request(await read_body(request), DetokenizeRequest, cfg.model_name)
        vocab = runtime.entry.vocab_size if runtime.entry is not None else len(tokenizer)
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"tokens must be token ids in [0, {vocab})", param="tokens")
        return JSONResponse({"prompt": tokenizer.decode(body.tokens)})

    @app.get("/version")
    async def version(request: Request) -> Response:
        check_auth(request)
        return JSONResponse({"version": __version__})

    return app
