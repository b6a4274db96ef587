"""Structured output with xgrammar: schemas checked at the edge, grammars compiled (and cached) per
model, and one matcher per request whose state follows the request's committed output tokens.

The matcher is a function of the output tokens, whoever wrote them: it is advanced lazily, just
before the logits are masked and when a token is committed, over the output tokens it has not seen
yet. A hand-off therefore carries nothing new: the receiving model's matcher catches up on the
peer's tokens at its next mask, and a rewrite (a peer cutting the output at some position) rolls it
back. Preemption and the prefix cache change no output token, so they leave it alone. xgrammar was
chosen by measurement (docs/BENCHMARKS.md, grammar libraries).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import xgrammar as xgr

from tokenrouter.engine.request_validation import InvalidRequest
from tokenrouter.sampling_params import StructuredOutput

# JSON without free whitespace (", " and ": " between items): a model cannot run its output out on
# whitespace, which small models do when any amount is allowed.
_JSON_OPTIONS: dict[str, Any] = {"any_whitespace": False}
_ANY_OBJECT = '{"type": "object"}'
_CACHE_BYTES = 64 << 20


def check_structured_output(so: StructuredOutput) -> None:
    """Raise InvalidRequest (param response_format) when the schema is not one xgrammar can enforce.
    Needs no tokenizer: this runs at the edge, before any model sees the request."""
    if so.json is None:
        return
    try:
        xgr.Grammar.from_json_schema(str(so.json), **_JSON_OPTIONS)
    except Exception as e:  # noqa: BLE001 - xgrammar raises several types for a bad schema
        raise InvalidRequest(f"response_format: invalid JSON schema: {e}", "response_format") from None


class GrammarViolation(RuntimeError):
    """A committed token the request's grammar does not accept (the models disagree on the vocabulary)."""


class GrammarState:
    """One request's matcher on one model and the output tokens it has accepted."""

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)
        self.accepted = 0  # output tokens the matcher has taken

    def sync(self, output: Sequence[int]) -> None:
        """Advance over the output tokens not yet accepted."""
        for tok in output[self.accepted:]:
            if self.matcher.is_terminated():
                raise GrammarViolation(f"token {tok} follows the end of the grammar")
            if not self.matcher.accept_token(tok):
                raise GrammarViolation(f"token {tok} is not allowed by the grammar here")
            self.accepted += 1

    def truncate(self, n_output: int) -> None:
        """The output was cut to n_output tokens (a peer rewrites from there): roll the matcher back."""
        if n_output < self.accepted:
            self.matcher.rollback(self.accepted - n_output)
            self.accepted = n_output

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: the request must end."""
        return self.matcher.is_terminated()


class GrammarCompiler:
    """One model's compiler: its tokenizer's vocabulary at the logits width, the model's EOS ids as the
    grammar's stop tokens, and compiled grammars cached by schema (xgrammar's cache, 64 MiB at most)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(eos_token_ids))
        # Bounded: a server that sees many distinct schemas keeps the recent ones (LRU), not all.
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=_CACHE_BYTES)

    def state(self, so: StructuredOutput) -> GrammarState:
        # json_object is any JSON object (OpenAI's meaning; vLLM compiles the same schema), not any value.
        schema = _ANY_OBJECT if so.json is None else str(so.json)
        try:
            compiled = self.compiler.compile_json_schema(schema, **_JSON_OPTIONS)
        except Exception as e:  # noqa: BLE001
            raise InvalidRequest(f"response_format: invalid JSON schema: {e}", "response_format") from None
        return GrammarState(compiled)


def apply_grammar_masks(logits: torch.Tensor, rows: list[int], states: list[GrammarState],
                        outputs: list[Sequence[int]]) -> None:
    """Mask logits [S, V] in place: row rows[i] keeps only the tokens states[i] allows next, after
    the state caught up on outputs[i]."""
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[-1])  # all allowed
    for row, state, output in zip(rows, states, outputs):
        state.sync(output)
        state.matcher.fill_next_token_bitmask(bitmask, row)
    # Only the grammar rows are touched (xgrammar's CPU kernel here, its GPU kernels on a GPU).
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                    indices=None if len(rows) == logits.shape[0] else rows)
