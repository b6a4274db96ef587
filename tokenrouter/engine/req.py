"""A request as one subserver sees it: its tokens, how many of them have KV, and its pages."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from tokenrouter.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenrouter.engine.grammar import GrammarState
    from tokenrouter.engine.radix_cache import TreeNode
    from tokenrouter.engine.tokenizer import IncrementalDetokenizer


class ReqStatus(enum.Enum):
    WAITING = "waiting"  # queued for admission; holds no pages
    RUNNING = "running"  # admitted; scheduled at every step until it finishes
    PENDING = "pending"  # at a peer model: skipped by the scheduler, pages and prefix lock kept
    FINISHED = "finished"


class LooseVerify(NamedTuple):
    """FLy's gate (vLLM's `rejection_sample_method: fly`), lossy: a verifier keeps a draft its own
    sample rejects where it is itself unsure, the normalised entropy of its three largest
    probabilities (at its temperature, greedy at 1; 0 for one certain token, 1 for three equal ones) above
    `entropy`, and its own samples agree with the next `window` drafts (as many as follow, at least one)."""

    entropy: float
    window: int


@dataclass(eq=False)  # identity: two requests are never equal
class Req:
    """One request on one model.

    Invariants:
    - `tokens[:kv_len]` have KV in `pages`; a scheduled request feeds `tokens[kv_len:]`, so prefill,
      chunked prefill, catching up on a peer's suffix and decoding are the same operation.
    - `pages[:cached_len // page_size]` belong to the prefix cache and are locked through
      `cache_node`; the rest are private to this request. `cached_len` is page aligned.
    - A WAITING request holds no pages and no lock.
    - `look_ahead`: RUNNING though handed to a peer, for one row: its last token, which this model
      wrote and has not computed. The engine sets the row's sample aside and turns it PENDING
      (Engine.hand_off); the scheduler never preempts it for it nor launches a step for it alone.
    - `drafts`: the last `drafts` tokens are a peer's proposals for this model to verify, not yet
      output (speculative decoding). The next step samples at each of them and at the token before,
      keeps the longest run its own samples agree with and commits it (Engine.accept_drafts); so
      while RUNNING, `extend_len > drafts`, and the step's last chunk holds every verified row. (The
      proposing model appends its drafts as plain tokens: Engine.append_draft.) `loose`: the rule
      those drafts are verified by, None (exact) whenever there are none.
    """

    rid: str
    tokens: list[int]
    prompt_len: int
    params: SamplingParams
    seed: int
    status: ReqStatus = ReqStatus.WAITING
    kv_len: int = 0
    pages: list[int] = field(default_factory=list)
    cached_len: int = 0
    cache_node: TreeNode | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[dict[int, float]] = field(default_factory=list)
    text: str = ""  # decoded output, kept only while stop strings need it
    detok: IncrementalDetokenizer | None = None  # streaming or stop strings: decodes text as tokens come
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finish_time: float | None = None
    extended_tokens: int = 0  # tokens this request ran through the model (recompute included)
    prefix_hit_tokens: int = 0  # tokens taken from the prefix cache at the last admission
    num_preemptions: int = 0
    look_ahead: bool = False
    drafts: int = 0
    loose: LooseVerify | None = None
    pending_since: float = 0.0  # when it last went PENDING (monotonic): after its look-ahead row, which ran here
    grammar: GrammarState | None = None  # this model's matcher of the structured output, if any
    # Prompt logprobs (params.prompt_logprobs): one entry per prompt token from the second on, filled
    # by the prefill; complete when it holds prompt_len - 1 entries.
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[dict[int, float]] = field(default_factory=list)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all computed yet: its prompt must run through the model."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.prompt_len - 1

    @property
    def may_draft(self) -> bool:
        """Whether its tokens may be drafted and verified (speculative decoding): a verifier samples
        a draft's position from the model's own logits and reports no logprob for it, so no rule
        may change the logits (grammar, logit_bias, min_tokens, penalties) and no logprobs are asked."""
        p = self.params
        return (self.grammar is None and not p.logit_bias and p.min_tokens == 0 and not p.penalized
                and p.logprobs is None)

    @property
    def extend_len(self) -> int:
        return len(self.tokens) - self.kv_len

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def at_peer(self) -> bool:
        """Handed to a peer: PENDING, or RUNNING for its look-ahead row."""
        return self.status is ReqStatus.PENDING or self.look_ahead

    def pending_seconds(self, now: float) -> float:
        """How long it has been PENDING; 0 when it is not (RUNNING for its look-ahead row included)."""
        return now - self.pending_since if self.status is ReqStatus.PENDING else 0.0

    @property
    def finished(self) -> bool:
        return self.status is ReqStatus.FINISHED

    def private_pages(self, page_size: int) -> list[int]:
        return self.pages[self.cached_len // page_size:]
