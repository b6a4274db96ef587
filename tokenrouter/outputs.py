"""Results of the offline API, in vLLM's shape."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None
    finished_time: float | None
    # Known to a single-model engine; None where a routed group's entry cannot know them.
    num_cached_tokens: int | None  # prompt tokens taken from the prefix cache at the last admission
    num_computed_tokens: int | None  # tokens run through the model, recompute after preemption included
    num_preemptions: int | None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class TokenTrace:
    """One output token's attribution, for a routed request that asked for it (routing {"trace": true})."""

    model: str  # the model that wrote it
    # The models the request passed through since the previous token, ending with `model` (a hand-off
    # from each to the next); empty: no hand-off before this token.
    handoff: list[str]
    score: float | None  # the router's score at this position (None: the algorithm has none)
    threshold: float | None  # what the score was compared with
    # The drafts `model` verified and rejected at this position (speculative decoding): the run this
    # token replaces; empty elsewhere.
    rejected: list[int] = field(default_factory=list)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" (EOS, stop token or stop string), "length", "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[dict[int, float]] | None = None  # per output token: sampled token and top-k
    cumulative_logprob: float | None = None
    token_models: list[str] | None = None  # routed groups: the model that wrote each token
    trace: list[TokenTrace] | None = None  # routed requests that asked for it: each token's attribution


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    extra: dict[str, object] = field(default_factory=dict)
    # With SamplingParams.prompt_logprobs, as vLLM: None for the first prompt token, then for each prompt
    # token {its id: its logprob, **the top ones}.
    prompt_logprobs: list[dict[int, float] | None] | None = None


def prompt_logprob_entries(prompt_ids: list[int], logprobs: list[float],
                           top: list[dict[int, float]]) -> list[dict[int, float] | None]:
    """vLLM's shape of prompt logprobs: None for the first token (nothing predicts it), then
    {token: logprob, **top logprobs} for each of the others."""
    return [None] + [{tok: lp, **t} for tok, lp, t in zip(prompt_ids[1:], logprobs, top)]
