"""The stop-string matcher: only matches that reach the new characters count, the earliest wins,
and the search is confined to the text's tail."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenrouter.engine.stop_strings import find_stop


def naive(text: str, num_new: int, stops: list[str]) -> tuple[int, str] | None:
    best = None
    for s in stops:
        pos = text.find(s, max(0, len(text) - num_new - len(s) + 1))
        if pos != -1 and (best is None or pos < best[0]):
            best = (pos, s)
    return best


def at(text: str, num_new: int, stops: list[str]) -> tuple[int, str] | None:
    """Where the stop string starts (the text before it is what a stop without it keeps)."""
    hit = find_stop(text, num_new, stops, include=False)
    return None if hit is None else (len(hit.text), hit.stop)


def test_match_in_new_text():
    assert at("hello world", 3, ["wor", "xyz"]) == (6, "wor")
    assert at("hello world", 1, ["o"]) is None  # both o's are before the new "d"
    assert at("abcabc", 1, ["c"]) == (5, "c")
    assert at("ab", 0, ["b"]) is None
    assert at("ab", 2, []) is None


def test_earliest_match_wins_and_first_listed_breaks_ties():
    assert at("xxSTOPend", 7, ["end", "STOP"]) == (2, "STOP")
    assert at("xxab", 2, ["ab", "a"]) == (2, "ab")


def test_match_across_the_boundary():
    # "STOP" starts in old text and ends in the new character.
    assert at("..STOP", 1, ["STOP"]) == (2, "STOP")


def test_only_the_tail_is_read():
    # A text far longer than the stops: the answer is the same as the naive full search's.
    text = "a" * 100_000 + "END"
    assert at(text, 2, ["END", "zzz"]) == (100_000, "END")


@settings(max_examples=300, derandomize=True)
@given(st.text(alphabet="ab", max_size=30), st.integers(0, 30),
       st.lists(st.text(alphabet="ab", min_size=1, max_size=4), max_size=5))
def test_same_as_naive(text, num_new, stops):
    num_new = min(num_new, len(text))
    assert at(text, num_new, stops) == naive(text, num_new, stops)


def test_include_keeps_the_stop_string():
    assert find_stop("say END now", 5, ["END"], include=True).text == "say END"
    assert find_stop("say END now", 5, ["END"], include=False).text == "say "
