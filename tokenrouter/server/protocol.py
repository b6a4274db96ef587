"""OpenAI request schemas (validated strictly) and the error body OpenAI clients expect."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from tokenrouter.sampling_params import SamplingParams, StructuredOutput

MAX_LOGPROBS = 20
# Integers as the engine and the messages between processes carry them (msgpack int64, torch int64):
# a larger value is refused here, naming the field, instead of failing deep inside a model process.
MAX_INT32 = 2**31 - 1
MAX_SEED = 2**63 - 1
TokenId = Annotated[int, Field(ge=0, le=MAX_INT32)]
Count = Annotated[int, Field(ge=1, le=MAX_INT32)]
# Below these a float32 underflows in the sampler; they mean "only the most likely token" anyway.
MIN_TEMPERATURE = 1e-5  # a smaller positive temperature samples greedily
MIN_TOP_P = 1e-6  # a smaller top_p keeps only the most likely token, as this one does


@dataclass(frozen=True)
class RequestLimits:
    """Sizes a request may have (the server's --max-* flags); past them it is refused with 400."""

    max_prompt_chars: int = 1 << 20  # characters of prompt text (all chat messages together)
    max_stop_strings: int = 16
    max_stop_chars: int = 256  # characters per stop string
    max_stop_token_ids: int = 256

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
MAX_CHOICES = 128  # prompts x n in one request: each choice is a routed request of its own
MAX_LOGIT_BIAS = 300  # entries of logit_bias, as OpenAI allows


def public_message(error: str | None) -> str:
    """What a client may read of an internal error message: its first line (never a traceback)."""
    lines = (error or "").strip().splitlines()
    return lines[0][:500] if lines else "unknown error"


class APIError(Exception):
    """An error answered with an OpenAI-style body: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    # Strict: "5" is not an integer. Unknown fields are accepted and ignored, as OpenAI's own SDK
    # sends fields (user, metadata, ...) that change nothing here.
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # extension (vLLM): usage on every chunk


class _Sampling(_Strict):
    model: str = Field(max_length=256)
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=MAX_INT32)  # extension (vLLM, SGLang)
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None  # extension
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    ignore_eos: bool = False  # extension
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string, as OpenAI sends it) -> bias
    repetition_penalty: float | None = None  # extension (vLLM, SGLang)
    min_tokens: int = Field(0, ge=0, le=MAX_INT32)  # extension (vLLM, SGLang)
    include_stop_str_in_output: bool = False  # extension (vLLM)
    # {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": {"name", "schema",
    # "strict"?, "description"?}}: the output follows the grammar (OpenAI; vLLM takes it on both endpoints)
    response_format: dict[str, Any] | None = None
    # Extension: this request's routing parameters (e.g. {"threshold": 0.3} for R2R), checked by the
    # group's algorithm; the group's values are the defaults. The runtime's own fields: "trace" (a
    # per-token trace in each choice) and "model" (one model writes it alone), routing/request_options.py.
    routing: dict[str, Any] | None = None

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def check_common(self, limits: RequestLimits) -> None:
        if not 1 <= self.n <= MAX_CHOICES:
            raise APIError(400, f"n must be in [1, {MAX_CHOICES}], got {self.n}", param="n")
        self.structured_output()  # its shape; the schema itself is checked at admission
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options can only be given when stream is true", param="stream_options")
        stops = self.stop_strings()
        if len(stops) > limits.max_stop_strings:
            raise APIError(400, f"stop: at most {limits.max_stop_strings} stop strings, got {len(stops)}",
                           param="stop")
        if any(not s or len(s) > limits.max_stop_chars for s in stops):
            raise APIError(400, f"stop: each stop string must have 1 to {limits.max_stop_chars} characters",
                           param="stop")
        if len(self.stop_token_ids or ()) > limits.max_stop_token_ids:
            raise APIError(400, f"stop_token_ids: at most {limits.max_stop_token_ids} ids", param="stop_token_ids")
        if len(self.logit_bias or ()) > MAX_LOGIT_BIAS:
            raise APIError(400, f"logit_bias: at most {MAX_LOGIT_BIAS} entries", param="logit_bias")

    def structured_output(self) -> StructuredOutput | None:
        """response_format as the grammar it asks for (None: free text)."""
        rf = self.response_format
        if rf is None:
            return None
        kind = rf.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return StructuredOutput(json_object=True)
        if kind != "json_schema":
            raise APIError(400, f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                           param="response_format")
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"]:
            raise APIError(400, "response_format json_schema must be an object with a name", param="response_format")
        schema = spec.get("schema", {})  # OpenAI: no schema means any JSON
        if not isinstance(schema, dict):
            raise APIError(400, "response_format json_schema.schema must be a JSON schema object",
                           param="response_format")
        try:
            return StructuredOutput(json=schema)
        except ValueError as e:
            raise APIError(400, f"response_format: {e}", param="response_format") from None

    def usage_options(self) -> tuple[bool, bool]:
        """(a final chunk with the usage, usage on every chunk): vLLM's reading of stream_options, where
        continuous_usage_stats counts only together with include_usage."""
        opts = self.stream_options
        include = bool(opts and opts.include_usage)
        return include, include and bool(opts and opts.continuous_usage_stats)

    def token_bias(self) -> dict[int, float]:
        """logit_bias with integer keys, each bias clamped to [-100, 100] as OpenAI and vLLM do."""
        out = {}
        for key, bias in (self.logit_bias or {}).items():
            try:
                tok = int(key)
            except ValueError:
                raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
            if not 0 <= tok <= MAX_INT32:
                raise APIError(400, f"logit_bias key {key!r} is not a token id", param="logit_bias")
            if math.isnan(bias):
                raise APIError(400, f"logit_bias of token {tok} is not a number", param="logit_bias")
            out[tok] = min(100.0, max(-100.0, bias))
        return out

    def sampling(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None,
                 ) -> SamplingParams:
        """The request's SamplingParams; max_tokens None (fill the context) is resolved at admission."""
        temperature = 1.0 if self.temperature is None else self.temperature
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=0.0 if temperature < MIN_TEMPERATURE else temperature,
                top_p=1.0 if self.top_p is None else max(self.top_p, MIN_TOP_P),
                top_k=self.top_k or 0,
                seed=self.seed, stop=self.stop_strings(), stop_token_ids=list(self.stop_token_ids or []),
                ignore_eos=self.ignore_eos, logprobs=logprobs,
                include_stop_str_in_output=self.include_stop_str_in_output, min_tokens=self.min_tokens,
                frequency_penalty=self.frequency_penalty or 0.0, presence_penalty=self.presence_penalty or 0.0,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                logit_bias=self.token_bias(), structured_output=self.structured_output(),
                prompt_logprobs=prompt_logprobs,
            )
        except ValueError as e:  # SamplingParams' messages start with the field's name
            raise APIError(400, str(e), param=str(e).split(" ", 1)[0]) from None


class CompletionRequest(_Sampling):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: Count | None = 16
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    return_token_ids: bool = False  # extension (as vLLM): the choice carries its token ids

    @property
    def prompt_logprobs(self) -> int | None:
        """echo with logprobs: the prompt tokens' logprobs (and as many top ones) open the choice's."""
        return self.logprobs if self.echo else None

    def prompts(self, limits: RequestLimits) -> list[str | list[int]]:
        """The prompts (one text or token list, or a list of them); the request makes n choices for each."""
        p = self.prompt
        prompts: list[str | list[int]] = (list(p) if isinstance(p, list) and p and isinstance(p[0], (str, list))
                                          else [p])  # type: ignore[list-item]
        if len(prompts) * self.n > MAX_CHOICES:
            raise APIError(400, f"{len(prompts)} prompts x n={self.n} is over {MAX_CHOICES} choices", param="n")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"logprobs must be in [0, {MAX_LOGPROBS}]", param="logprobs")
        total = sum(len(q) for q in prompts)
        if total > limits.max_prompt_chars:
            raise APIError(400, f"prompt: at most {limits.max_prompt_chars} characters (or token ids), "
                                f"got {total}", param="prompt", code="prompt_too_long")
        return prompts


class ChatMessage(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, "only text content parts are supported", param="messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def texts(self, limits: RequestLimits) -> list[dict[str, str]]:
        """The messages as {role, content} with text content, within the prompt-size limit."""
        out = [{"role": m.role, "content": m.text()} for m in self.messages]
        size = sum(len(m["content"]) for m in out)
        if size > limits.max_prompt_chars:
            raise APIError(400, f"messages: at most {limits.max_prompt_chars} characters in all, got {size}",
                           param="messages", code="prompt_too_long")
        return out

    def requested_logprobs(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = Field(None, max_length=1 << 22)
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (as vLLM)
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[TokenId] = Field(max_length=1 << 20)


def parse_tool_request(raw: bytes | bytearray, model: type[BaseModel], served_name: str) -> Any:
    """A /tokenize or /detokenize body, whose model is optional (checked only when given)."""
    req = _validate(raw, model)
    name = getattr(req, "model", None)
    if name is not None and name != served_name:
        raise APIError(404, f"the model {name!r} does not exist; this server serves {served_name!r}",
                       param="model", code="model_not_found")
    return req


def validation_message(exc: Any) -> tuple[str, str | None]:
    """A one-line message and the offending field from a pydantic ValidationError."""
    err = exc.errors()[0]
    loc = ".".join(str(x) for x in err.get("loc", ()))
    msg = err.get("msg", "invalid value")
    return (f"{loc}: {msg}" if loc else msg), (loc or None)


def _validate(raw: bytes | bytearray, model: type[BaseModel]) -> Any:
    """`raw` JSON as `model`; APIError 400 naming the field otherwise (deep nesting included)."""
    try:
        json.loads(raw)
    except ValueError:
        raise APIError(400, "the request body is not valid JSON") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    try:
        return model.model_validate_json(raw)
    except pydantic.ValidationError as e:
        msg, param = validation_message(e)
        raise APIError(400, msg, param=param) from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None


def parse_request(raw: bytes | bytearray, model: type[_Sampling], served_name: str,
                  limits: RequestLimits = RequestLimits()) -> Any:
    """A request body as `model`, for the model named `served_name`; APIError (400/404) otherwise."""
    req = _validate(raw, model)
    if req.model != served_name:
        raise APIError(404, f"the model {req.model!r} does not exist; this server serves {served_name!r}",
                       param="model", code="model_not_found")
    req.check_common(limits)
    return req


def completion_chunk(rid: str, created: int, model: str, index: int, text: str, reason: str | None,
                     logprobs: dict[str, Any] | None, token_ids: list[int] | None) -> dict[str, Any]:
    """One `text_completion` object (a stream chunk, or a response's choice) with the choice `index`;
    token_ids only when the request asked for them."""
    choice: dict[str, Any] = {"index": index, "text": text, "finish_reason": reason, "logprobs": logprobs}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}
