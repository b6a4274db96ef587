"""The entry's parts without processes: admission (one check, one max_tokens cap, the KV footprint),
the admission queue's reservations, the reassembly of out-of-order tokens with stop strings, and the
stop-string matcher the engine shares."""

from __future__ import annotations

import pytest

from tokenrouter.engine.request_validation import InvalidRequest
from tokenrouter.engine.stop_strings import find_stop, held_back
from tokenrouter.runtime.entry.admission import AdmissionQueue, AdmissionRules, PoolSize
from tokenrouter.runtime.entry.reassembly import Done, Reassembly, TokenOut
from tokenrouter.runtime.messages import TokenEvent
from tokenrouter.sampling_params import SamplingParams

RULES = AdmissionRules(context_len=32, vocab_size=100,
                       pools={"small": PoolSize(4, 64), "large": PoolSize(8, 64)})


class CharTokenizer:
    """Token i is the character chr(i): enough for the incremental detokenizer."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(map(chr, ids))


def test_offline_plan_caps_max_tokens_at_the_context_and_reserves_whole_pages():
    plan = RULES.plan(list(range(10)), SamplingParams(max_tokens=100, seed=7, stop=["x"]))
    assert plan.params.max_tokens == 22 and plan.params.stop == ["x"] and plan.seed == 7
    assert plan.model_params().stop == [] and plan.model_params().max_tokens == 22
    assert plan.reserve == {"small": 32, "large": 32}
    small = RULES.plan([1, 2, 3], SamplingParams(max_tokens=2))
    assert small.params.max_tokens == 2 and small.reserve == {"small": 8, "large": 8}
    one_model = AdmissionRules(32, 100, {"small": PoolSize(4, 64)})
    assert one_model.plan([1, 2, 3], SamplingParams(max_tokens=2)).reserve == {}


def test_openai_plan_fills_the_context_or_refuses_past_it():
    plan = RULES.plan_openai([1, 2, 3], SamplingParams(max_tokens=None))
    assert plan.params.max_tokens == 29
    with pytest.raises(InvalidRequest, match="maximum context length is 32 tokens") as e:
        RULES.plan_openai([1, 2, 3], SamplingParams(max_tokens=30))
    assert e.value.param == "max_tokens"
    # min_tokens is checked against the resolved cap too
    with pytest.raises(InvalidRequest, match="min_tokens must be at most max_tokens \\(29\\)") as e:
        RULES.plan_openai([1, 2, 3], SamplingParams(max_tokens=None, min_tokens=30))
    assert e.value.param == "min_tokens"


@pytest.mark.parametrize("prompt,max_tokens,message,param", [
    ([], 4, "prompt is empty", "prompt"),
    ([1, 100], 4, r"integers in \[0, 100\)", "prompt"),
    ([1] * 32, 4, "32 tokens, but the context is 32 tokens", "prompt"),
])
def test_bad_prompts_name_the_problem(prompt, max_tokens, message, param):
    with pytest.raises(InvalidRequest, match=message) as e:
        RULES.plan(prompt, SamplingParams(max_tokens=max_tokens))
    assert e.value.param == param


def test_a_footprint_past_a_pool_is_refused():
    tight = AdmissionRules(64, 100, {"small": PoolSize(4, 64), "large": PoolSize(8, 16)})
    with pytest.raises(ValueError, match="needs 24 tokens of KV on model 'large', whose pool holds 16"):
        tight.plan([1] * 10, SamplingParams(max_tokens=10))


def test_queue_admits_in_order_while_every_pool_has_room():
    class Req:
        def __init__(self, n: int) -> None:
            self.plan = RULES.plan(list(range(1, n + 1)), SamplingParams(max_tokens=4))

    queue: AdmissionQueue[Req] = AdmissionQueue({"small": 60, "large": 60})
    big, small, late = Req(20), Req(2), Req(2)  # footprints (small/large): 24/24, 8/8, 8/8
    for r in (big, big2 := Req(20), small, late):
        queue.push(r)
    assert queue.pop_admissible() is big and queue.pop_admissible() is big2
    assert queue.pop_admissible() is small and queue.reserved == {"small": 56, "large": 56}
    assert queue.pop_admissible() is None  # late needs 8 more (56 + 8 > 60): waits
    queue.release(big)
    assert queue.pop_admissible() is late and queue.reserved == {"small": 40, "large": 40}
    queue.push(r := Req(2))
    queue.withdraw(r)
    assert not queue.waiting


def _reassembly(stop: list[str], release_text: bool = True, include: bool = False) -> Reassembly:
    plan = RULES.plan([ord(c) for c in "ab"], SamplingParams(max_tokens=20, stop=stop,
                                                             include_stop_str_in_output=include))
    return Reassembly.of("r", plan, CharTokenizer(), release_text)


def test_tokens_out_of_order_come_out_in_position_order_with_held_back_text():
    out = _reassembly(stop=["xyz"])
    out.put(TokenEvent("r", 3, ord("d")), "large")
    assert out.drain() == []  # position 2 is missing
    out.put(TokenEvent("r", 2, ord("c"), -0.5, {ord("c"): -0.5}), "small")
    toks = out.drain()
    assert [(t.token, t.model) for t in toks] == [(ord("c"), "small"), (ord("d"), "large")]
    assert toks[0] == TokenOut("r", ord("c"), "small", "", -0.5, {ord("c"): -0.5})
    assert "".join(t.text for t in toks) == ""  # len("xyz") - 1 characters are held back
    out.put(TokenEvent("r", 3, ord("q")), "small")  # a position already placed: dropped
    out.put(TokenEvent("r", 4, ord("e")), "small")
    assert [t.text for t in out.drain()] == ["c"]
    out.finish()
    assert out.release() == "de" and out.text == "cde"
    assert out.tokens_per_model() == {"small": 2, "large": 1}
    out.handoffs = 3  # PeerReqs sent, as the subservers report them (not changes of writer)
    done = out.done("length", None, None)
    assert isinstance(done, Done) and done.tokens_per_model == {"small": 2, "large": 1} and done.handoffs == 3


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_across_tokens_ends_the_output(include):
    out = _reassembly(stop=["yz"], include=include)
    for pos, ch in enumerate("wxyzq", start=2):
        out.put(TokenEvent("r", pos, ord(ch)), "small")
    toks = out.drain()
    assert [chr(t.token) for t in toks] == ["w", "x", "y", "z"]  # nothing past the stop
    assert out.stop == "yz" and out.finished and out.text == ("wxyz" if include else "wx")
    assert "".join(t.text for t in toks) == out.text


def test_without_text_release_tokens_carry_no_text():
    out = _reassembly(stop=[], release_text=False)
    out.put(TokenEvent("r", 2, ord("c")), "small")
    assert [t.text for t in out.drain()] == [""] and out.detok is None


def test_find_stop_takes_the_earliest_match_in_the_new_text():
    assert find_stop("hello world", 5, ["world", "o w"], include=False) == ("hell", "o w")
    assert find_stop("hello world", 5, ["world"], include=True) == ("hello world", "world")
    assert find_stop("hello world", 2, ["hello"], include=False) is None  # matched before, not new
    assert held_back(["ab", "abcd"]) == 3 and held_back([]) == 0
