"""Reassembly: a routed request's tokens come back from several models, each with its absolute
position, possibly out of order. Here they are put back in order, detokenized, checked for stop
strings (here, where the whole text is), and their text is released, less any tail that could still
grow into a stop string.

TokenOut and Done are the entry's only output shapes: the offline API, the benchmarks and the HTTP
handlers all receive these.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from tokenrouter.engine.stop_strings import held_back, output_stop
from tokenrouter.engine.tokenizer import IncrementalDetokenizer
from tokenrouter.runtime.entry.admission import AdmittedPlan
from tokenrouter.runtime.messages import TokenEvent, Trace


class TokenOut(NamedTuple):
    """One output token of request `rid`, in position order."""

    rid: str
    token: int
    model: str  # the model that wrote it
    text: str  # text released with it (text-releasing entries only; never a broken character)
    logprob: float | None = None  # when the request asked for logprobs
    top_logprobs: dict[int, float] | None = None
    # On the first token of a request that asked for prompt logprobs: (logprob of each prompt token from
    # the second on, the top ones at each of those positions).
    prompt_logprobs: tuple[list[float], list[dict[int, float]]] | None = None
    trace: Trace | None = None  # when the request asked for a per-token trace (routing.trace)


class Done(NamedTuple):
    """The end of request `rid`: its last event."""

    rid: str
    finish_reason: str
    stop_reason: int | str | None
    text: str  # the last released text
    error: str | None
    tokens_per_model: dict[str, int]
    handoffs: int  # hand-offs performed (PeerReqs sent, every model counted)
    fatal: bool = False  # the group failed, not this request
    routing: dict[str, Any] | None = None  # the routing parameters the request ran with


@dataclass(eq=False)
class Reassembly:
    """One request's output as it comes back."""

    rid: str
    prompt_len: int
    stops: list[str]
    include_stop: bool
    detok: IncrementalDetokenizer | None  # with stop strings, or when text is released
    release_text: bool
    tokens: list[TokenOut] = field(default_factory=list)
    buffer: dict[int, tuple[TokenEvent, str]] = field(default_factory=dict)  # by position, not yet in order
    text: str | None = None  # the final text (cut by a stop string, or the whole once finished)
    stop: str | None = None  # the stop string that ended the output
    finished: bool = False
    released: int = 0  # characters of text already handed out
    first_token_time: float | None = None
    min_tokens: int = 0  # stop strings wait for more tokens than this (stop_strings.output_stop)
    handoffs: int = 0  # PeerReqs sent so far, as the subservers report them (not changes of writer)
    # Prompt logprobs: asked for, and (once the prefilling model sent them) their values. They come on
    # another connection than a peer's first token may, so the first token waits for them.
    wants_prompt_logprobs: bool = False
    prompt_logprobs: tuple[list[float], list[dict[int, float]]] | None = None

    @classmethod
    def of(cls, rid: str, plan: AdmittedPlan, tokenizer: Any, release_text: bool) -> Reassembly:
        p = plan.params
        detok = IncrementalDetokenizer(tokenizer, plan.prompt_ids) if p.stop or release_text else None
        return cls(rid, len(plan.prompt_ids), p.stop, p.include_stop_str_in_output, detok, release_text,
                   min_tokens=p.min_tokens, wants_prompt_logprobs=p.prompt_logprobs is not None)

    @property
    def next_pos(self) -> int:
        return self.prompt_len + len(self.tokens)

    @property
    def output(self) -> list[int]:
        return [t.token for t in self.tokens]

    def tokens_per_model(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for t in self.tokens:
            counts[t.model] = counts.get(t.model, 0) + 1
        return counts

    def put(self, item: TokenEvent, model: str) -> None:
        """A token from `model`; one already placed (a position a model wrote again) is dropped."""
        if item.pos >= self.next_pos:
            self.buffer[item.pos] = (item, model)

    def drain(self) -> list[TokenOut]:
        """The tokens that are now in order, each with the text it releases; none past a stop string
        (then `stop` is set and the output is finished)."""
        out: list[TokenOut] = []
        if self.wants_prompt_logprobs and self.prompt_logprobs is None:
            return out
        while not self.finished and self.next_pos in self.buffer:
            item, model = self.buffer.pop(self.next_pos)
            if self.first_token_time is None:
                self.first_token_time = time.monotonic()
            if self.detok is not None:
                self._add_text(item.token)
            top = (item.top_logprobs or {}) if item.logprob is not None else None
            tok = TokenOut(self.rid, item.token, model, self.release(), item.logprob, top,
                           None if self.tokens else self.prompt_logprobs, item.trace)
            self.tokens.append(tok)
            out.append(tok)
        return out

    def _add_text(self, token: int) -> None:
        assert self.detok is not None
        new = self.detok.add([token])
        if not new or not self.stops:
            return
        hit = output_stop(self.detok.text, len(new), self.stops, self.include_stop, len(self.tokens) + 1,
                          self.min_tokens)  # len(self.tokens) + 1: this token is not yet placed
        if hit is not None:
            self.text, self.stop = hit.text, hit.stop
            self.finish()

    def finish(self) -> None:
        """No more tokens: the whole text is final (what release hands out next holds nothing back)."""
        self.finished = True
        if self.detok is not None and self.text is None:
            self.text = self.detok.text

    def release(self) -> str:
        """Text not yet handed out, less a tail that could still grow into a stop string."""
        if not self.release_text or self.detok is None:
            return ""
        text = self.text if self.text is not None else self.detok.text
        hold = 0 if self.finished else held_back(self.stops)
        end = max(self.released, len(text) - hold)
        out, self.released = text[self.released:end], end
        return out

    def done(self, reason: str, stop_reason: int | str | None, error: str | None, text: str = "",
             routing: dict[str, Any] | None = None) -> Done:
        return Done(self.rid, reason, stop_reason, text, error, self.tokens_per_model(), self.handoffs, routing=routing)
