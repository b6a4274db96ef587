"""The OpenAI-compatible HTTP API over a routed group (a single model is a group of one)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
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

from tokenrouter.runtime.entry.adaptation import AdaptState
from tokenrouter.server.async_entry import TokenOut
from tokenrouter.server.chat import ChatTemplateError, SpecialTokens, encode_chat, special_token_texts
from tokenrouter.server.choices import ChoiceRunner
from tokenrouter.server.generation import finish_reason, routing, total_routing, trace_entries, usage
from tokenrouter.server.logprobs import LogprobFormat
from tokenrouter.server.metrics import ServerMetrics
from tokenrouter.server.page import mount_ui
from tokenrouter.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    RequestLimits,
    TokenizeRequest,
    completion_chunk,
    parse_request,
    parse_tool_request,
    public_message,
    validation_message,
)
from tokenrouter.server.runtime_switch import Runtime
from tokenrouter.version import __version__

logger = logging.getLogger(__name__)
T = TypeVar("T")
# Parsing or tokenising this many characters (or body bytes) takes well under a millisecond: such
# work runs on the event loop at once, so a short request never queues behind huge prompts that the
# tokenizer pool is busy with.
INLINE_CHARS = 16_384


@dataclass
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = 8 << 20  # a longer body is refused (413) before it is parsed
    request_timeout: float | None = None  # seconds; a request running longer is aborted (408 / error event)
    limits: RequestLimits = field(default_factory=RequestLimits)
    tokenizer_threads: int = 2  # the pool that tokenises prompts, off the event loop
    chat_special_tokens: SpecialTokens = "escape"  # see server/chat.py
    ui: bool = True  # serve the routing page at / (server/ui/)

    def __post_init__(self) -> None:
        if self.tokenizer_threads < 1:
            raise ValueError(f"tokenizer_threads must be at least 1, got {self.tokenizer_threads}")
        if self.chat_special_tokens not in ("escape", "allow"):
            raise ValueError(f"chat_special_tokens must be 'escape' or 'allow', got {self.chat_special_tokens!r}")


def chat_size(messages: list[dict[str, str]]) -> int:
    """Characters of chat content, the size that decides where the messages are tokenised."""
    return sum(len(m["content"]) for m in messages)


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex[:16]}"


def _check_bearer(header: str, api_key: str) -> bool:
    """Whether an Authorization header carries the key; the scheme is case-insensitive (RFC 9110)."""
    scheme, _, token = header.strip().partition(" ")
    ok_scheme = hmac.compare_digest(scheme.lower().encode(), b"bearer")
    return hmac.compare_digest(token.strip().encode(), api_key.encode()) and ok_scheme


class OpenAIServer:
    """The handlers of the HTTP API and what they share: the group, the tokenizer and its thread pool,
    the metrics. build_app wires them into a FastAPI app. `serving` gives the model card's `serving`
    (server/pair_upgrade.py); None: the card has none."""

    def __init__(self, runtime: Runtime, tokenizer: Any, cfg: ServerConfig,
                 serving: Callable[[], dict[str, Any]] | None = None) -> None:
        self.runtime, self.tokenizer, self.cfg, self.serving = runtime, tokenizer, cfg, serving
        self.metrics = ServerMetrics(cfg.model_name)
        self.created = int(time.time())  # the model card's `created`: when this server started
        # Parsing a large body and tokenising a long prompt take seconds: on the event loop they would
        # stall every endpoint.
        self.pool = ThreadPoolExecutor(cfg.tokenizer_threads, thread_name_prefix="tokenrouter-tokenize")
        self.specials = special_token_texts(tokenizer)
        self.logprobs = LogprobFormat(tokenizer)
        self.choices = ChoiceRunner(runtime, self.metrics, cfg.request_timeout)
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

    # ---- shared steps ------------------------------------------------------------------------
    def check_auth(self, request: Request) -> None:
        key = self.cfg.api_key
        if key is not None and not _check_bearer(request.headers.get("authorization", ""), key):
            raise APIError(401, "invalid API key", type_="authentication_error", code="invalid_api_key")

    async def read_body(self, request: Request) -> bytes:
        limit = self.cfg.max_body_bytes
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > limit:
                raise APIError(413, f"the request body is over {limit} bytes", code="body_too_large")
        return bytes(body)

    async def parse(self, request: Request, model: type[pydantic.BaseModel]) -> Any:
        body = await self.read_body(request)
        # Parsing and validating up to max_body_bytes of JSON takes long enough to stall the loop.
        return await self.off_loop(lambda: parse_request(body, model, self.cfg.model_name, self.cfg.limits),
                                   len(body))

    async def off_loop(self, fn: Callable[[], T], size: int) -> T:
        """fn() in the tokenizer pool, or on the event loop at once when its input (`size` characters,
        bytes or token ids) is at most INLINE_CHARS."""
        if size <= INLINE_CHARS:
            return fn()
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn)

    def context_len(self) -> int:
        assert self.runtime.entry is not None
        return self.runtime.entry.context_len

    # ---- endpoints ---------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        self.check_auth(request)
        body: CompletionRequest = await self.parse(request, CompletionRequest)
        n = body.n
        prompts = body.prompts(self.cfg.limits)
        encoded = await self.off_loop(lambda: [list(self.tokenizer.encode(p)) if isinstance(p, str) else list(p)
                                               for p in prompts], sum(len(p) for p in prompts))
        sampling = body.sampling(body.max_tokens, body.logprobs, body.prompt_logprobs)
        gens = self.choices.submit_choices(encoded, n, sampling, body.routing)
        rid, created = gens[0].stream.rid, int(time.time())
        want_lp = body.logprobs is not None
        traced = gens[0].traced
        model_name = self.cfg.model_name
        # echo: each choice's text opens with its prompt's text
        echoed = ([p if isinstance(p, str) else self.tokenizer.decode(p) for p in prompts for _ in range(n)]
                  if body.echo else None)

        # echo with logprobs: the prompt's text and logprobs open each choice's first chunk (they come with
        # its first token), so no separate echo chunk is sent.
        prompt_lp = body.prompt_logprobs is not None
        unechoed = set(range(len(gens))) if prompt_lp else set()

        def chunk(i: int, toks: list[TokenOut], text: str, reason: str | None) -> dict[str, Any]:
            logprobs = self.logprobs.completion(toks, 0) if want_lp else None
            if i in unechoed and (toks or reason is not None):
                unechoed.discard(i)
                assert echoed is not None
                logprobs = self.logprobs.completion(toks, len(echoed[i]))
                head = self.logprobs.prompt(encoded[i // n], toks[0].prompt_logprobs if toks else None)
                logprobs = {key: head[key] + logprobs[key] for key in head}
                text = echoed[i] + text
            out = completion_chunk(rid, created, model_name, i, text, reason, logprobs,
                                   [t.token for t in toks] if body.return_token_ids else None)
            if traced:
                out["choices"][0]["trace"] = trace_entries(toks, self.tokenizer)
            return out

        if body.stream:
            every = want_lp or body.return_token_ids
            return StreamingResponse(self.choices.stream_events(gens, n, chunk, body.usage_options(), every,
                                                        body.return_token_ids, None if prompt_lp else echoed),
                                     media_type="text/event-stream")
        await self.choices.run_to_end(request, gens)
        choices = []
        for i, gen in enumerate(gens):
            assert gen.done is not None
            text = (echoed[i] if echoed and not prompt_lp else "") + gen.text
            choices.append({**chunk(i, gen.tokens, text, finish_reason(gen.done))["choices"][0],
                            "routing": routing(gen, body.return_token_ids)})
        out = {**chunk(0, [], "", None), "choices": choices, "usage": usage(gens, n)}
        return JSONResponse({**out, "routing": total_routing(gens, body.return_token_ids)})

    async def chat_completions(self, request: Request) -> Response:
        self.check_auth(request)
        body: ChatCompletionRequest = await self.parse(request, ChatCompletionRequest)
        messages = body.texts(self.cfg.limits)
        try:
            ids = await self.off_loop(lambda: encode_chat(self.tokenizer, messages, self.cfg.chat_special_tokens,
                                                          self.specials), chat_size(messages))
        except ChatTemplateError as e:
            raise APIError(400, f"the chat template rejected the messages: {public_message(str(e))}",
                           param="messages") from None
        logprobs = body.requested_logprobs()
        gens = self.choices.submit_choices([ids], body.n, body.sampling(body.max_completion_tokens or body.max_tokens,
                                                                        logprobs), body.routing)
        rid, created = "chat" + gens[0].stream.rid, int(time.time())
        first = [True] * len(gens)
        traced = gens[0].traced
        model_name = self.cfg.model_name

        def chunk(i: int, toks: list[TokenOut], text: str, reason: str | None) -> dict[str, Any]:
            delta: dict[str, Any] = {"content": text} if text or reason is None else {}
            if first[i]:
                delta = {"role": "assistant", **delta}
                first[i] = False
            choice = {"index": i, "delta": delta, "finish_reason": reason,
                      "logprobs": self.logprobs.chat(toks) if logprobs is not None else None}
            if traced:
                choice["trace"] = trace_entries(toks, self.tokenizer)
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                    "choices": [choice]}

        if body.stream:
            return StreamingResponse(self.choices.stream_events(gens, body.n, chunk, body.usage_options(),
                                                        logprobs is not None),
                                     media_type="text/event-stream")
        await self.choices.run_to_end(request, gens)
        choices = []
        for i, gen in enumerate(gens):
            assert gen.done is not None
            choices.append({"index": i, "message": {"role": "assistant", "content": gen.text},
                            "finish_reason": finish_reason(gen.done),
                            "logprobs": self.logprobs.chat(gen.tokens) if logprobs is not None else None,
                            "routing": routing(gen),
                            **({"trace": trace_entries(gen.tokens, self.tokenizer)} if traced else {})})
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": created, "model": model_name,
            "choices": choices, "usage": usage(gens, body.n), "routing": total_routing(gens)})

    # ---- the endpoints vLLM users script against ------------------------------------------------
    async def tokenize(self, request: Request) -> Response:
        self.check_auth(request)
        raw = await self.read_body(request)
        body: TokenizeRequest = parse_tool_request(raw, TokenizeRequest, self.cfg.model_name)
        body.check()
        if body.messages is not None:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            try:
                ids = await self.off_loop(lambda: encode_chat(self.tokenizer, messages, self.cfg.chat_special_tokens,
                                                              self.specials, body.add_generation_prompt),
                                          chat_size(messages))
            except ChatTemplateError as e:
                raise APIError(400, f"the chat template rejected the messages: {public_message(str(e))}",
                               param="messages") from None
        else:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await self.off_loop(lambda: list(self.tokenizer.encode(body.prompt, add_special_tokens=special)),
                                      len(body.prompt or ""))
        out: dict[str, Any] = {"count": len(ids), "max_model_len": self.context_len() if self.runtime.entry else None,
                               "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = self.tokenizer.convert_ids_to_tokens(ids)
        return JSONResponse(out)

    async def detokenize(self, request: Request) -> Response:
        self.check_auth(request)
        raw = await self.read_body(request)
        body: DetokenizeRequest = parse_tool_request(raw, DetokenizeRequest, self.cfg.model_name)
        vocab = self.runtime.entry.vocab_size if self.runtime.entry is not None else len(self.tokenizer)
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"tokens must be token ids in [0, {vocab})", param="tokens")
        return JSONResponse({"prompt": await self.off_loop(lambda: self.tokenizer.decode(body.tokens),
                                                           len(body.tokens))})

    async def version(self, request: Request) -> Response:
        self.check_auth(request)
        return JSONResponse({"version": __version__})

    async def models(self, request: Request) -> Response:
        """vLLM's model card: clients read `root` (`vllm bench serve` without --model fails on a card
        without it, and loads its tokenizer from there when not given --tokenizer). Here root is the
        folder the server's tokenizer comes from; `members` (extension) names the group's models, and
        `routing` (extension) the algorithm: its per-request parameters with the group's values, the
        one that sets the other models' share (`share_knob`, and whether raising it raises the share),
        what its per-token score is (`score`, None: it has none), and, on a server that adapts to load,
        the adaptation's live state (`adaptive`: the knob's value now, its served point and floor, the
        target and the last window's p99 TPOT and token shares). The embedded default served
        before its routed pair was prepared adds `serving` (extension): what serves (`group`, as each
        response's `routing.serving`) and the pair's preparation, start and switch, or why it failed
        (`pair`; server/pair_upgrade.py)."""
        self.check_auth(request)
        entry = self.runtime.entry
        root = self.runtime.group.spec(entry.algorithm.entry_model).engine.model_path if entry else None
        return JSONResponse({"object": "list", "data": [{
            "id": self.cfg.model_name, "object": "model", "created": self.created, "owned_by": "tokenrouter",
            "root": root, "parent": None, "max_model_len": self.context_len() if entry else None,
            "permission": [{"id": f"modelperm-{self.created}", "object": "model_permission",
                            "created": self.created, "allow_create_engine": False, "allow_sampling": True,
                            "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                            "allow_fine_tuning": False, "organization": "*", "group": None,
                            "is_blocking": False}],
            "members": self.runtime.group.names, "routing": self.routing_card(),
            **({"serving": self.serving()} if self.serving else {})}]})

    def routing_card(self) -> dict[str, Any] | None:
        entry = self.runtime.entry
        if entry is None:
            return None
        algo = entry.algorithm
        knob = algo.share_knob
        card = {"algorithm": algo.name, "params": algo.request_defaults(), "score": algo.score_name,
                "share_knob": knob[0] if knob else None, "knob_raises_share": knob[1] if knob else None}
        adapt = self.adaptive_state()
        return card if adapt is None else {**card, "adaptive": adapt.to_dict()}

    def adaptive_state(self) -> AdaptState | None:
        """Load adaptation as of its last window (None: the server does not adapt)."""
        entry = self.runtime.entry
        return entry.adaptation.state if entry is not None and entry.adaptation is not None else None

    async def health(self) -> Response:
        if self.runtime.healthy:
            return JSONResponse({"status": "ok"})
        # Unauthenticated: the cause goes to the log, not here.
        return JSONResponse({"status": "unavailable", "error": "the model group is not serving"}, status_code=503)

    async def metrics_endpoint(self, request: Request) -> Response:
        self.check_auth(request)
        stats = await self.runtime.stats() if self.runtime.healthy else {}
        waiting, running = self.runtime.queue_lengths()
        return Response(self.metrics.render(stats, waiting, running, self.adaptive_state()),
                        media_type="text/plain; version=0.0.4")


def build_app(runtime: Runtime, tokenizer: Any, cfg: ServerConfig,
              serving: Callable[[], dict[str, Any]] | None = None) -> FastAPI:
    server = OpenAIServer(runtime, tokenizer, cfg, serving)

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
    app.add_api_route("/tokenize", server.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", server.detokenize, methods=["POST"])
    app.add_api_route("/version", server.version, methods=["GET"])
    if cfg.ui:
        mount_ui(app)
    return app
