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

Run: `tokenrouter baseline standard --small-url URL --large-url URL --small-tokenizer PATH --p 0.1`
or `python -m tokenrouter.bench.baselines.standard ...`. `StandardStack` starts the two plain servers and
the coordinator (for benchmarks and tests) and stops them all.
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
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tokenrouter.bench.server_process import ManagedProcess, free_port
from tokenrouter.routing.bernoulli import hands_off
from tokenrouter.server.async_entry import Done, TokenOut

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# The coordinator
# --------------------------------------------------------------------------------------------


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
class _Backend:
    name: str  # writer name reported in "routing"
    url: str
    model: str = ""  # the name the backend answers to
    context_len: int | None = None


@dataclass
class _Gen:
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


class _Text:
    """Incremental text of one request with stop strings, released as the routed server does."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int], stops: list[str]) -> None:
        from tokenrouter.engine.tokenizer import IncrementalDetokenizer

        self.det = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.stops = stops
        self.final: str | None = None  # the text cut at a stop string
        self.released = 0

    def add(self, token: int) -> bool:
        """Add a token; True when it completes a stop string (the text is then cut before it)."""
        new = self.det.add([token])
        if not new or not self.stops:
            return False
        text = self.det.text
        for stop in self.stops:
            pos = text.find(stop, max(0, len(text) - len(new) - len(stop) + 1))
            if pos != -1:
                self.final = text[:pos]
                return True
        return False

    def release(self, done: bool) -> str:
        text = self.final if self.final is not None else self.det.text
        hold = 0 if done else max((len(s) - 1 for s in self.stops), default=0)
        end = max(self.released, len(text) - hold)
        out, self.released = text[self.released:end], end
        return out


class Coordinator:
    """The routing loop over two plain servers, one token per backend request."""

    def __init__(self, cfg: StandardConfig, tokenizer: Any) -> None:
        from tokenrouter.routing.bernoulli import Bernoulli

        Bernoulli([cfg.small_name, cfg.large_name], cfg.p)  # validates p
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.small = _Backend(cfg.small_name, cfg.small_url.rstrip("/"))
        self.large = _Backend(cfg.large_name, cfg.large_url.rstrip("/"))
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

        async def ok(b: _Backend) -> bool:
            try:
                assert self.client is not None
                return (await self.client.get(f"{b.url}/health", timeout=5.0)).status_code == 200
            except httpx.HTTPError:
                return False

        return all(await asyncio.gather(ok(self.small), ok(self.large)))

    def routed(self, seed: int, position: int) -> bool:
        """The Bernoulli router's decision for `position` (= len(prompt + output so far))."""
        return bool(hands_off([seed], [position], self.cfg.p)[0])

    async def one_token(self, b: _Backend, context: list[int], sampling: dict[str, Any]) -> tuple[int, str, Any]:
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

    async def generate(self, ids: list[int], gen: _Gen, max_tokens: int, sampling: dict[str, Any], seed: int,
                       stops: list[str]) -> AsyncIterator[TokenOut | Done]:
        """Yield each token as it is written, then the Done; fills `gen` as it goes."""
        context = list(ids)
        text = _Text(self.tokenizer, ids, stops)
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
        gen = _Gen(rid, len(ids))
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


# --------------------------------------------------------------------------------------------
# Launcher: two plain servers + the coordinator, for benchmarks and tests
# --------------------------------------------------------------------------------------------


def start_plain_server(name: str, model_path: str | Path, log_dir: Path, cores: Sequence[int] | None = None,
                       server_args: Sequence[str] = (), source: Sequence[str] | None = None) -> ManagedProcess:
    """`tokenrouter serve --model-path PATH` on a free port (not yet waited for). `source` replaces
    `--model-path PATH` (e.g. `--config ONE_MODEL.yaml` for a model on the latency-model executor)."""
    port = free_port()
    cmd = [sys.executable, "-m", "tokenrouter.cli", "serve", *(source or ["--model-path", str(model_path)]),
           "--port", str(port), "--log-level", "warning", "--grace-period", "5", *server_args]
    return ManagedProcess(name, cmd, port, log_dir, cores)


def start_coordinator(small_url: str, large_url: str, small_tokenizer: str | Path, p: float, log_dir: Path,
                      model_name: str = "standard", cores: Sequence[int] | None = None,
                      name: str = "coordinator", extra_args: Sequence[str] = ()) -> ManagedProcess:
    """The coordinator (`python -m tokenrouter.bench.baselines.standard`) on a free port (not yet waited for)."""
    port = free_port()
    cmd = [sys.executable, "-m", "tokenrouter.bench.baselines.standard", "--small-url", small_url,
           "--large-url", large_url, "--small-tokenizer", str(small_tokenizer), "--p", repr(float(p)),
           "--port", str(port), "--model-name", model_name, "--log-level", "warning", *extra_args]
    return ManagedProcess(name, cmd, port, log_dir, cores)


class StandardStack:
    """The whole standard-serving baseline: small and large plain servers plus the coordinator.

        with StandardStack(small_path, large_path, p=0.1, small_cores=[0], large_cores=[1]) as stack:
            ... POST f"{stack.url}/v1/completions" with model=stack.model_name ...

    Every process runs with OMP_NUM_THREADS=1 (plus `taskset -c` when cores are given); stop() (or
    leaving the `with`) sends SIGTERM, then SIGKILL, and leaves no process behind.
    """

    def __init__(self, small_path: str | Path, large_path: str | Path, p: float, *,
                 small_cores: Sequence[int] | None = None, large_cores: Sequence[int] | None = None,
                 coordinator_cores: Sequence[int] | None = None, server_args: Sequence[str] = (),
                 small_source: Sequence[str] | None = None, large_source: Sequence[str] | None = None,
                 model_name: str = "standard", log_dir: str | Path | None = None,
                 startup_timeout: float = 180.0) -> None:
        """`small_source` / `large_source`: serve arguments naming each model instead of `--model-path`
        (see start_plain_server); the small folder's tokenizer still serves the coordinator."""
        self.small_path, self.large_path, self.p = Path(small_path), Path(large_path), float(p)
        self.sources = {"small": small_source, "large": large_source}
        self.small_cores, self.large_cores, self.coordinator_cores = small_cores, large_cores, coordinator_cores
        self.server_args = list(server_args)
        self.model_name = model_name
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if log_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="standard-stack-")
            log_dir = self._tmp.name
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.startup_timeout = startup_timeout
        self.procs: list[ManagedProcess] = []
        self.small: ManagedProcess | None = None
        self.large: ManagedProcess | None = None
        self.coordinator: ManagedProcess | None = None

    @property
    def url(self) -> str:
        assert self.coordinator is not None, "start() first"
        return self.coordinator.url

    def start(self) -> "StandardStack":
        try:
            self.small = start_plain_server("small", self.small_path, self.log_dir, self.small_cores, self.server_args,
                                            self.sources["small"])
            self.procs.append(self.small)
            self.large = start_plain_server("large", self.large_path, self.log_dir, self.large_cores, self.server_args,
                                            self.sources["large"])
            self.procs.append(self.large)
            self.small.wait_healthy(self.startup_timeout)
            self.large.wait_healthy(self.startup_timeout)
            self.coordinator = self.add_coordinator(self.p, self.model_name, name="coordinator",
                                                    cores=self.coordinator_cores)
        except BaseException:
            self.stop()
            raise
        return self

    def add_coordinator(self, p: float, model_name: str, name: str | None = None,
                        cores: Sequence[int] | None = None, wait: bool = True) -> ManagedProcess:
        """Another coordinator over the same two servers (e.g. a different p); stopped with the stack."""
        assert self.small is not None and self.large is not None, "start() first"
        proc = start_coordinator(self.small.url, self.large.url, self.small_path, p, self.log_dir, model_name,
                                 cores, name or f"coordinator-{len(self.procs)}")
        self.procs.append(proc)
        if wait:
            proc.wait_healthy(self.startup_timeout)
        return proc

    def stop(self) -> None:
        # Coordinators first (they hold connections to the servers), then the servers in parallel.
        for proc in reversed(self.procs):
            if proc.name.startswith("coordinator"):
                proc.stop()
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.stop()

    def alive_pids(self) -> list[int]:
        return [pid for proc in self.procs for pid in proc.alive_pids()]

    def cleanup_logs(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> "StandardStack":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self.cleanup_logs()


if __name__ == "__main__":
    sys.exit(main())
