"""The checks every request passes once, at the edge that receives it: the offline engine's
add_request, and the routed entry's admission (which serves both the offline API and HTTP)."""

from __future__ import annotations

from collections.abc import Sequence


class InvalidRequest(ValueError):
    """A request that cannot run; the message names the problem and `param` the request field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def validate_prompt(prompt_ids: Sequence[int], vocab_size: int, context_len: int) -> None:
    """Raise InvalidRequest unless the prompt is non-empty token ids of the vocabulary that leave room
    for at least one output token."""
    if not prompt_ids:
        raise InvalidRequest("prompt is empty: a request needs at least one token", "prompt")
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size for t in prompt_ids):
        raise InvalidRequest(f"prompt token ids must be integers in [0, {vocab_size})", "prompt")
    if len(prompt_ids) >= context_len:
        raise InvalidRequest(f"the prompt has {len(prompt_ids)} tokens, but the context is {context_len} tokens "
                             "(the prompt must leave room for at least one output token)", "prompt")
