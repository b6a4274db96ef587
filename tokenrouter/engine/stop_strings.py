"""Stop strings: where the first one in a growing output text ends it.

One matcher for every place that stops on text: the single-model engine (its own detokenized output)
and the routed entry (the whole text of a request that several models wrote). A match that is new
must end in the new characters, so it starts at most `len(stop) - 1` characters before them: only
that tail is searched, and a token costs O(count x (longest + new characters)) whatever the text's
length or the number of tokens so far. The server bounds the count and the length of stop strings
(`--max-stop-strings`, `--max-stop-chars`), which bounds that cost.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class StopHit(NamedTuple):
    text: str  # the output text up to the stop string, and including it when asked
    stop: str  # the stop string that matched


def find_stop(text: str, num_new: int, stops: Sequence[str], include: bool) -> StopHit | None:
    """The earliest stop string that overlaps the last `num_new` characters of `text` (an earlier
    match would have been found when its text arrived); on a tie, the first in `stops`."""
    if num_new <= 0:
        return None
    best: tuple[int, str] | None = None
    for s in stops:
        if not s:
            continue
        pos = text.find(s, max(0, len(text) - num_new - len(s) + 1))
        if pos != -1 and (best is None or pos < best[0]):
            best = (pos, s)
    if best is None:
        return None
    pos, stop = best
    return StopHit(text[:pos + (len(stop) if include else 0)], stop)


def output_stop(text: str, num_new: int, stops: Sequence[str], include: bool, num_output: int,
                min_tokens: int) -> StopHit | None:
    """find_stop on a request's output of `num_output` tokens (the newest counted): as vLLM, no stop
    string ends an output until more than `min_tokens` tokens are out."""
    if num_output <= min_tokens:
        return None
    return find_stop(text, num_new, stops, include)


def held_back(stops: Sequence[str]) -> int:
    """How many characters at the end of a streamed text could still grow into a stop string, so
    must not be handed out yet."""
    return max((len(s) - 1 for s in stops), default=0)
