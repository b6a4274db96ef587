"""Per-request sampling and stopping settings, in vLLM's shape."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StructuredOutput:
    """A grammar the output must follow (vLLM's StructuredOutputsParams, JSON kinds): `json`, a JSON
    schema (a dict or its JSON text), or `json_object`, any JSON object. Exactly one is set.

    The schema is kept as canonical JSON text (sorted keys), so it travels to every model of a group
    as is and each model can cache its compiled grammar by that text.
    """

    json: str | dict[str, Any] | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        if (self.json is None) == (not self.json_object):
            raise ValueError("structured_output needs exactly one of json (a JSON schema) and json_object")
        if self.json is not None:
            try:
                schema = json.loads(self.json) if isinstance(self.json, str) else self.json
                if not isinstance(schema, (dict, bool)):
                    raise TypeError("a JSON schema is an object")
                self.json = json.dumps(schema, sort_keys=True)
            except (TypeError, ValueError) as e:
                raise ValueError(f"structured_output json must be a JSON schema: {e}") from None

    @property
    def key(self) -> str:
        """What identifies the grammar (its compiled form is cached under it)."""
        return "json_object" if self.json is None else str(self.json)


@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    temperature 0 means greedy. top_k 0 (or -1) and top_p 1.0 disable those filters.
    A request with a seed samples the same tokens whatever else shares its batches: the random
    stream is a pure function of (seed, position), so no generator state has to be carried.

    The logits processing fields act as vLLM's do, in its order: `logit_bias` (token id -> added
    logit) and `min_tokens` (EOS and stop_token_ids masked, stop strings ignored, until that many
    tokens are out; with a structured output the grammar alone decides when EOS may come), then
    `repetition_penalty` (divides positive / multiplies negative logits of
    tokens seen in prompt or output), `frequency_penalty` (minus penalty x count in the output) and
    `presence_penalty` (minus penalty once per token present in the output). Each is a function of
    the token history only, so every model of a routed group applies the same rule.

    `structured_output` constrains the output to a grammar (JSON schema or any JSON object), masking
    the logits before all of the above; the request ends when the grammar is complete. The grammar's
    state, too, is a function of the output tokens only.

    `prompt_logprobs` (k): the logprob of every prompt token but the first, and the k most likely
    tokens at each of those positions, computed from the prefill (vLLM's prompt_logprobs).
    """

    max_tokens: int | None = 16  # None: up to the context (a routed group's admission resolves it)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    structured_output: StructuredOutput | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must be a mapping of token id to bias, got {self.logit_bias!r}")
        self.logit_bias = dict(self.logit_bias)
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        if self.max_tokens is not None:
            if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
                raise ValueError(f"max_tokens must be an integer, got {self.max_tokens!r}")
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be a non-negative integer (or -1), got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            raise ValueError(f"structured_output must be a StructuredOutput, got {self.structured_output!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not (self.repetition_penalty > 0.0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(f"repetition_penalty must be a positive number, got {self.repetition_penalty}")
        for tok, bias in self.logit_bias.items():
            if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                raise ValueError(f"logit_bias keys must be non-negative token ids, got {tok!r}")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
                raise ValueError(f"logit_bias values must be finite numbers, got {bias!r} for token {tok}")

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ValueError when logit_bias names a token outside [0, vocab_size)."""
        bad = sorted(t for t in self.logit_bias if t >= vocab_size)
        if bad:
            raise ValueError(f"logit_bias has token ids outside the vocabulary [0, {vocab_size}): {bad[:8]}")

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes the logits (requests without one skip the counting)."""
        return (self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
