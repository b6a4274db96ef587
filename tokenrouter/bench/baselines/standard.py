"""The standard-serving baseline: token-level routing done OUTSIDE the serving systems.

Each model runs in its own plain single-model server (`tokenrouter serve --model-path ...`, an
OpenAI-compatible API). A coordinator, itself an OpenAI-compatible server, runs the routing loop
for every client request: for each output position it asks the small server for ONE token,
resending the whole context (prompt + output so far) as a new request; the router (the same
Bernoulli rule as `tokenrouter.routing.bernoulli`: hand position i of a request with seed s to the
large model when `hands_off([s], [i], p)[0]`) decides; if the position is handed off, the
small token is dropped and the large server is asked for that position's token instead (as R2R
does). Every token therefore costs one HTTP request (two when routed), a scheduling round and a
prefill of the new suffix on the server (its prefix cache holds the rest).

The small model is always asked first, even though the Bernoulli draw does not depend on its token:
a real router (R2R, CITER) needs the small model's output to decide, and this baseline models that.

Sampling is reproducible across the two systems: the coordinator sends both backends the request's
seed (the client's, or one it draws), and our sampler's randomness is a pure function of
(seed, position), so with the same seed the coordinator writes exactly the tokens the routed
runtime writes.

This file is the coordinator's HTTP app and command line; the routing loop is in
standard_coordinator.py and `StandardStack` (the two plain servers plus the coordinator, for benchmarks
and tests) in standard_stack.py.

Run: `tokenrouter baseline standard --small-url URL --large-url URL --small-tokenizer PATH --p 0.1`
or `python -m tokenrouter.bench.baselines.standard ...`.
"""

# No `from __future__ import annotations`: FastAPI reads the endpoints' annotations (Request) at
# runtime, and those classes are imported inside build_app to keep this module light for the CLI.

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from tokenrouter.bench.baselines.standard_coordinator import BackendError, Coordinator, Generation, StandardConfig
from tokenrouter.server.async_entry import TokenOut

logger = logging.getLogger(__name__)


def build_app(cfg: StandardConfig, tokenizer: Any | None = None) -> Any:
    """The coordinator's FastAPI app: POST /v1/completions, GET /v1/models, GET /health."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    from tokenrouter.server.protocol import APIError, CompletionRequest, RequestLimits, completion_chunk, parse_request

    if tokenizer is None:
        from tokenrouter.engine.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(cfg.small_tokenizer)
    coord = Coordinator(cfg, tokenizer)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await coord.start()
        try:
            yield
        finally:
            await coord.close()

    app = FastAPI(title="tokenrouter standard-serving coordinator", lifespan=lifespan)
    app.state.coordinator = coord

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    def check_auth(request: Request) -> None:
        if cfg.api_key is not None and request.headers.get("authorization", "") != f"Bearer {cfg.api_key}":
            raise APIError(401, "invalid API key", type_="authentication_error", code="invalid_api_key")

    def sse(obj: Any) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    def logprobs_of(toks: list[TokenOut], offset: int) -> dict[str, Any]:
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t in toks:
            out["tokens"].append(tokenizer.decode([t.token]))
            out["token_logprobs"].append(t.logprob)
            out["top_logprobs"].append(t.top_logprobs or {})
            out["text_offset"].append(offset)
            offset += len(t.text)
        return out

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        check_auth(request)
        body = parse_request(await request.body(), CompletionRequest, cfg.model_name)
        prompts = body.prompts(RequestLimits())
        if len(prompts) != 1 or body.n != 1 or body.echo:
            raise APIError(400, "the standard-serving baseline takes one prompt, n=1 and no echo", param="prompt")
        prompt = prompts[0]
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        params = body.sampling(1, body.logprobs)  # validates the sampling fields as the plain server does
        if params.logit_bias or params.min_tokens or params.penalized:
            raise APIError(400, "the standard-serving baseline takes no logit_bias, min_tokens or penalties")
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        ctx = coord.context_len
        max_tokens = body.max_tokens if body.max_tokens is not None else ctx - len(ids)
        if max_tokens < 1:
            raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
        if len(ids) + max_tokens > ctx:
            raise APIError(400, f"This model's maximum context length is {ctx} tokens. However, you requested "
                                f"{len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} in the "
                                "completion). Please reduce the length of the prompt or completion.",
                           param="max_tokens")
        seed = body.seed if body.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        sampling: dict[str, Any] = {"temperature": params.temperature, "top_p": params.top_p,
                                    "ignore_eos": params.ignore_eos}
        if params.top_k:
            sampling["top_k"] = params.top_k
        if params.stop_token_ids:
            sampling["stop_token_ids"] = list(params.stop_token_ids)
        if body.logprobs is not None:
            sampling["logprobs"] = body.logprobs
        rid, created = f"cmpl-std-{uuid.uuid4().hex[:16]}", int(time.time())
        gen = Generation(rid, len(ids))
        events = coord.generate(ids, gen, max_tokens, sampling, seed, list(params.stop))
        want_lp = body.logprobs is not None

        def chunk(toks: list[TokenOut], text: str, reason: str | None, offset: int = 0) -> dict[str, Any]:
            return completion_chunk(rid, created, cfg.model_name, 0, text, reason,
                                    logprobs_of(toks, offset) if want_lp else None,
                                    [t.token for t in toks] if body.return_token_ids else None)

        if body.stream:
            include = bool(body.stream_options and body.stream_options.include_usage)
            every = want_lp or body.return_token_ids

            async def stream() -> AsyncIterator[str]:
                pending: list[TokenOut] = []
                offset = 0
                try:
                    async for item in events:
                        if isinstance(item, TokenOut):
                            pending.append(item)
                            if item.text or every:
                                yield sse(chunk(pending, item.text, None, offset))
                                offset += sum(len(t.text) for t in pending)
                                pending = []
                        else:
                            yield sse({**chunk(pending, item.text, item.finish_reason, offset),
                                       "routing": gen.routing()})
                            if include:
                                yield sse({**chunk([], "", None), "choices": [], "usage": gen.usage()})
                except BackendError as e:
                    yield sse(APIError(e.status, str(e), type_="backend_error").body())
                yield "data: [DONE]\n\n"

            return StreamingResponse(stream(), media_type="text/event-stream")

        async def collect() -> None:
            async for _ in events:
                pass

        task = asyncio.create_task(collect())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=0.5)
                if not task.done() and await request.is_disconnected():
                    raise APIError(499, "client disconnected")
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, BackendError):
                    await task
        try:
            task.result()
        except BackendError as e:
            raise APIError(e.status, str(e), type_="backend_error") from None
        assert gen.done is not None
        out = chunk(gen.tokens, gen.text, gen.done.finish_reason)
        return JSONResponse({**out, "usage": gen.usage(), "routing": gen.routing()})

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        check_auth(request)
        return JSONResponse({"object": "list", "data": [{
            "id": cfg.model_name, "object": "model", "created": 0, "owned_by": "tokenrouter",
            "max_model_len": coord.context_len or None, "members": [cfg.small_name, cfg.large_name]}]})

    @app.get("/health")
    async def health() -> Response:
        if await coord.healthy():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    return app


def serve_coordinator(cfg: StandardConfig, host: str = "127.0.0.1", port: int = 8100,
                      log_level: str = "info") -> None:
    import uvicorn

    from tokenrouter.server.serve import GracefulServer

    app = build_app(cfg)
    logger.info("standard-serving coordinator %r on http://%s:%d (small %s, large %s, p=%g)",
                cfg.model_name, host, port, cfg.small_url, cfg.large_url, cfg.p)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=5)
    GracefulServer(config).run()


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--small-url", required=True, help="base URL of the small model's plain server")
    p.add_argument("--large-url", required=True, help="base URL of the large model's plain server")
    p.add_argument("--small-tokenizer", required=True, help="model folder of the small model (its tokenizer)")
    p.add_argument("--p", type=float, required=True, help="Bernoulli routing probability per small-model token")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--model-name", default="standard", help="the model name clients send")
    p.add_argument("--small-name", default="small", help="the small model's name in 'routing'")
    p.add_argument("--large-name", default="large", help="the large model's name in 'routing'")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1")
    p.add_argument("--startup-timeout", type=float, default=120.0, help="seconds to wait for the backends")
    p.add_argument("--log-level", default="info")


def cmd_standard(args: argparse.Namespace) -> int:
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # it logs every backend request at INFO: one per token
    cfg = StandardConfig(small_url=args.small_url, large_url=args.large_url, small_tokenizer=args.small_tokenizer,
                         p=args.p, model_name=args.model_name, small_name=args.small_name,
                         large_name=args.large_name, api_key=args.api_key, startup_timeout=args.startup_timeout)
    serve_coordinator(cfg, args.host, args.port, args.log_level)
    return 0


def add_standard_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """Add `standard` (the standard-serving coordinator) to a subparsers group."""
    p = subparsers.add_parser("standard", help="standard-serving baseline: a coordinator over two plain servers, "
                                               "one token per request")
    _add_args(p)
    p.set_defaults(func=cmd_standard)
    return p


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = argparse.ArgumentParser(prog="python -m tokenrouter.bench.baselines.standard",
                                     description="The standard-serving coordinator (token-level routing outside "
                                                 "two plain single-model servers)")
    _add_args(parser)
    return cmd_standard(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
