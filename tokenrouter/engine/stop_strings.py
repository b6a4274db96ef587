"""Stop-string matching over text that grows a few characters per token.

A match that is new must end in the new characters, so it starts at most `longest - 1` characters
before them: only that tail is searched, and the cost of a token is O(count x (longest + new
characters)) whatever the text's length or the number of tokens so far. The server bounds the count
and the length of stop strings (`--max-stop-strings`, `--max-stop-chars`), which bounds that cost.
"""

from __future__ import annotations


def find_stop(text: str, num_new: int, stops: list[str]) -> tuple[int, str] | None:
    """(position in `text`, stop string) of the earliest stop string that overlaps the last `num_new`
    characters of `text` (the first listed wins a tie); None when there is none."""
    if num_new <= 0 or not stops:
        return None
    longest = max(len(s) for s in stops)
    start = max(0, len(text) - num_new - longest + 1)
    tail = text[start:]
    first_new = len(tail) - num_new
    best: tuple[int, str] | None = None
    for s in stops:
        if not s:
            continue
        pos = tail.find(s, max(0, first_new - len(s) + 1))
        if pos != -1 and (best is None or pos < best[0]):
            best = (pos, s)
    return None if best is None else (start + best[0], best[1])
