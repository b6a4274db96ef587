"""Hand-offs driven by hand: two Subservers in this process, stepped in a chosen order, the test as entry.

Covers what the process-level tests cannot pin down: a PENDING request keeps its pages on the sender,
a revisit computes only what the receiver has not seen, aborts in every hand-off state free every
page on both models, and a request finished by the peer is finished everywhere.
"""

from __future__ import annotations

import math

import pytest
import torch
from engine_utils import prompts_of
from routing_utils import PAGE, Rig, build_pair, find_seed, handoff_draws, only, peer_msgs

from tokenrouter.engine.req import ReqStatus
from tokenrouter.routing import PeerReq
from tokenrouter.runtime.messages import FirstVisit, Handoff, Peer, Tokens
from tokenrouter.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return build_pair(tmp_path_factory.mktemp("handoff-models"))


@pytest.fixture
def rig_factory(paths):
    rigs: list[Rig] = []

    def make(p: float, **kw) -> Rig:
        rig = Rig(paths, p, **kw)
        rigs.append(rig)
        return rig

    yield make
    for rig in rigs:
        rig.close()


def finish_all(rig: Rig, rids: list[str]) -> None:
    """Run until the entry has a Finished for every rid and both models hold nothing; check no leaks."""
    rig.pump(lambda: all(rig.finished(r) for r in rids) and not rig.small.engine.reqs and not rig.large.engine.reqs,
             f"{rids} finished everywhere")
    rig.settle()
    rig.assert_clean("small")
    rig.assert_clean("large")


# ---- PENDING keeps its pages --------------------------------------------------------------------
def test_pending_request_keeps_its_pages_on_the_sender(rig_factory, monkeypatch):
    p = 0.5
    rig = rig_factory(p)
    a_prompt, b_prompt = prompts_of([10, 7], seed=11)
    seed_a = find_seed([True], first=len(a_prompt), p=p)  # A goes to the large model at its first token
    seed_b = find_seed([False] * 6, first=len(b_prompt), p=p)  # B stays on the small model for 6 tokens
    small = rig.small.engine

    at_handoff: dict[str, tuple[list[int], int]] = {}
    real_set_pending = small.scheduler.set_pending

    def spy(req):
        at_handoff[req.rid] = (list(req.pages), small.pool.num_free)
        real_set_pending(req)

    monkeypatch.setattr(small.scheduler, "set_pending", spy)

    rig.add("A", a_prompt, seed_a, max_tokens=6)
    rig.step("small")  # prefill A, draw: hand off; the sampled token is dropped
    a = rig.req("small", "A")
    assert a is not None and a.status is ReqStatus.PENDING
    pages, free = at_handoff["A"]
    assert len(pages) == math.ceil(len(a_prompt) / PAGE)
    assert a.pages == pages and small.pool.num_free == free, "hand-off changed the sender's pages"
    assert a.kv_len == len(a_prompt) and a.tokens == a_prompt, "the dropped token must not be committed"
    small.check_integrity()

    # B runs on the small model for several steps while A waits at the peer (the large model is not
    # even drained yet, so A's PeerReq sits in its inbox).
    rig.add("B", b_prompt, seed_b, max_tokens=20)
    b = rig.req("small", "B")
    for i in range(6):
        rig.step("small")
        assert b.status is ReqStatus.RUNNING and len(b.tokens) == len(b_prompt) + i + 1
        assert a.status is ReqStatus.PENDING and a.pages == pages and a.kv_len == len(a_prompt)
        assert not set(pages) & small.pool.free_pages, "a PENDING request's page went back to the pool"
        assert small.pool.num_free == free - len(b.pages), "only B's growth may take pages"
        assert small.cache.total_pages == 0
        small.check_integrity()
    assert small.scheduler.num_preemptions == 0
    # The token messages travel over zmq: wait for all six rather than for the first batch to arrive.
    rig.wait_entry(lambda: len(rig.tokens("B")) >= 6, "B's six tokens at the entry")
    assert [(m, pos) for m, pos, _ in rig.tokens("B")] == [("small", len(b_prompt) + i) for i in range(6)]
    assert rig.tokens("A") == []

    # The large model writes A's token and hands it back: A resumes on the same pages.
    rig.drain_until("large", lambda: rig.req("large", "A") is not None, "A's first visit")
    rig.step("large")
    rig.drain_until("small", lambda: a.status is ReqStatus.RUNNING, "A back on small")
    assert a.pages[:len(pages)] == pages and a.kv_len == len(a_prompt) and a.extend_len == 1
    small.check_integrity()
    finish_all(rig, ["A", "B"])


# ---- a revisit computes only the unseen suffix ----------------------------------------------------
def test_second_visit_computes_only_the_unseen_suffix(rig_factory):
    p = 0.5
    rig = rig_factory(p)
    (prompt,) = prompts_of([9], seed=12)
    n = len(prompt)
    # Hand off at n, stay on small for n+1..n+3, hand off again at n+4.
    pattern = [True, False, False, False, True]
    seed = find_seed(pattern, first=n, p=p)
    small, large = rig.small.engine, rig.large.engine

    rig.add("A", prompt, seed, max_tokens=12)
    rig.step("small")
    s = rig.req("small", "A")
    assert s.status is ReqStatus.PENDING and s.extended_tokens == n

    # First visit: the large model prefills the whole prefix (nothing cached yet) and writes position n.
    rig.drain_until("large", lambda: rig.req("large", "A") is not None, "A's first visit")
    lr = rig.req("large", "A")
    assert lr.tokens == prompt and lr.prompt_len == n and lr.extended_tokens == 0
    before = large.stats.extended_tokens
    rig.step("large")
    assert lr.prefix_hit_tokens == 0 and lr.extended_tokens == n
    assert large.stats.extended_tokens - before == n
    assert lr.at_peer and lr.kv_len == n and len(lr.tokens) == n + 1
    rig.wait_entry(lambda: rig.tokens("A"), "the large model's token")
    assert rig.tokens("A") == [("large", n, lr.tokens[n])]

    # Back on small: it feeds just the large model's token, then writes n+1..n+3 and hands off at n+4.
    rig.drain_until("small", lambda: s.status is ReqStatus.RUNNING, "A back on small")
    assert s.tokens == lr.tokens and s.extend_len == 1
    ext = s.extended_tokens
    for _ in range(4):
        rig.step("small")
    assert s.extended_tokens - ext == 4  # n, n+1, n+2, n+3: one token per step, nothing recomputed
    assert s.status is ReqStatus.PENDING and len(s.tokens) == n + 4

    # The hand-off carries only what the large model has not been sent: tokens n+1..n+3 from loc n+1.
    msg = peer_msgs(rig.take_inbox("large"))
    item = only(msg)
    assert item.first is None and msg.sender == "small"
    assert item.req.loc == n + 1 and item.req.suffix == s.tokens[n + 1:] and len(item.req.suffix) == 3
    rig.large._handle(msg)
    assert lr.tokens == s.tokens and lr.status is ReqStatus.RUNNING
    # Unseen by the large model's KV: its own token at n (sampled, never fed) plus the suffix.
    assert lr.kv_len == n and lr.extend_len == len(item.req.suffix) + 1
    ext, before = lr.extended_tokens, large.stats.extended_tokens
    rig.step("large")
    assert lr.extended_tokens - ext == len(item.req.suffix) + 1
    assert large.stats.extended_tokens - before == len(item.req.suffix) + 1
    assert lr.kv_len == n + 4 and len(lr.tokens) == n + 5
    finish_all(rig, ["A"])

    # A second request with the same prompt and seed: its first visit to the large model now takes the
    # prompt's whole pages from the prefix cache and computes only the rest.
    rig.add("C", prompt, seed, max_tokens=12)
    rig.step("small")
    rig.drain_until("large", lambda: rig.req("large", "C") is not None, "C's first visit")
    c = rig.req("large", "C")
    before = large.stats.extended_tokens
    rig.step("large")
    assert c.prefix_hit_tokens == (n - 1) // PAGE * PAGE > 0
    assert c.extended_tokens == n - c.prefix_hit_tokens
    assert large.stats.extended_tokens - before == n - c.prefix_hit_tokens
    assert c.tokens[n] == lr.tokens[n], "the prefix cache changed the large model's greedy token"
    finish_all(rig, ["C"])
    small.check_integrity()


def test_one_peer_message_per_step_and_destination(rig_factory):
    """A step's hand-offs to one peer travel in one Peer message, in row order."""
    rig = rig_factory(1.0)  # every small-model token goes to the large model
    a, b = prompts_of([5, 7], seed=21)
    rig.add("A", a, seed=1, max_tokens=3)
    rig.add("B", b, seed=2, max_tokens=3)
    rig.step("small")  # prefills both; both hand off
    msg = peer_msgs(rig.take_inbox("large"))
    assert msg.sender == "small" and [i.req.rid for i in msg.items] == ["A", "B"]
    assert all(i.first is not None and i.handoffs == 1 for i in msg.items)
    rig.large._handle(msg)
    finish_all(rig, ["A", "B"])


def test_a_steps_messages_to_the_entry_go_out_during_the_next_step(rig_factory):
    """Overlap: a step's Tokens wait, and go out while the next step runs, or before the loop waits."""
    rig = rig_factory(0.0)  # no hand-offs
    (prompt,) = prompts_of([6], seed=22)
    n = len(prompt)
    rig.add("A", prompt, seed=3, max_tokens=4)
    rig.small._step()  # prefill: the token at n, its Tokens held back
    rig.collect(50)
    assert rig.small.io.outbox and not rig.tokens("A")
    rig.small._step()  # the token at n goes out while this step runs; n + 1 is held back
    rig.wait_entry(lambda: bool(rig.tokens("A")), "A's first token")
    assert [pos for _, pos, _ in rig.tokens("A")] == [n] and len(rig.small.io.outbox) == 1
    rig.small._drain(timeout_ms=1)  # about to wait: nothing stays unsent
    assert not rig.small.io.outbox
    rig.wait_entry(lambda: [pos for _, pos, _ in rig.tokens("A")] == [n, n + 1], "A's second token")
    finish_all(rig, ["A"])


def test_every_handoff_at_p1_sends_an_empty_suffix(rig_factory):
    """p = 1: the small model never commits, the large one writes every token; each revisit feeds just
    the large model's own last token (hand-off suffix empty) and its KV never restarts."""
    rig = rig_factory(1.0)
    (prompt,) = prompts_of([6], seed=13)
    n = len(prompt)
    rig.add("A", prompt, seed=5, max_tokens=4)
    large = rig.large.engine
    visits = []
    for k in range(4):
        rig.step("small")
        msg = peer_msgs(rig.take_inbox("large"))
        item = only(msg)
        assert (item.first is not None) == (k == 0)
        if k == 0:
            assert item.req.loc == 0 and item.req.suffix == prompt
        else:
            assert item.req.loc == n + k and item.req.suffix == []
        rig.large._handle(msg)
        lr = rig.req("large", "A")
        before = large.stats.extended_tokens
        rig.step("large")
        visits.append(large.stats.extended_tokens - before)
        if k < 3:
            rig.drain_until("small", lambda: rig.req("small", "A").status is ReqStatus.RUNNING, "hand-back")
    assert visits == [n, 1, 1, 1]
    assert lr.finished and lr.finish_reason == "length"
    rig.wait_entry(lambda: rig.finished("A"), "Finished")
    assert [m for m, _, _ in rig.tokens("A")] == ["large"] * 4
    rig.settle()
    rig.assert_clean("small")
    rig.assert_clean("large")


# ---- aborts -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["small_pending", "large_pending"])
def test_abort_while_pending_at_the_peer(rig_factory, where):
    """small_pending: A sits on the large model (queued) while small holds its PENDING pages.
    large_pending: the large model wrote its token and holds PENDING pages; the hand-back is in flight."""
    rig = rig_factory(1.0)
    (prompt,) = prompts_of([11], seed=14)
    rig.add("A", prompt, seed=3, max_tokens=10)
    rig.step("small")
    rig.drain_until("large", lambda: rig.req("large", "A") is not None, "A's first visit")
    held = None
    if where == "large_pending":
        rig.step("large")
        assert rig.req("large", "A").at_peer and rig.req("large", "A").pages
        held = rig.take_inbox("small")  # the hand-back, kept in flight until after the abort
        assert only(peer_msgs(held)).req.loc == len(prompt)
    assert rig.req("small", "A").status is ReqStatus.PENDING and rig.req("small", "A").pages

    rig.abort("A")
    rig.drain_until("small", lambda: "A" not in rig.small.engine.reqs, "abort on small")
    rig.drain_until("large", lambda: "A" not in rig.large.engine.reqs, "abort on large")
    rig.assert_clean("small")
    rig.assert_clean("large")

    # Late messages for the aborted rid resurrect nothing.
    if held is not None:
        rig.small._handle(peer_msgs(held))
        rig.send("small", peer_msgs(held))
    late_first = Peer("small", [Handoff(PeerReq(rid="A", suffix=list(prompt), loc=0),
                                        FirstVisit(len(prompt), SamplingParams(max_tokens=10, temperature=0.0), 3))])
    rig.send("large", late_first)
    rig.settle()
    rig.assert_clean("small")
    rig.assert_clean("large")
    assert rig.finished("A") == []

    # The rig keeps serving.
    rig.add("B", prompt, seed=4, max_tokens=3)
    finish_all(rig, ["B"])


@pytest.mark.parametrize("order", ["abort_first", "either"])
def test_abort_while_peer_req_in_flight(rig_factory, order):
    """The first-visit PeerReq is on the wire when the entry aborts. abort_first: the receiver handles
    the Abort before the PeerReq (held off the wire); either: both sit in its inbox, zmq picks the order."""
    rig = rig_factory(1.0)
    (prompt,) = prompts_of([9], seed=15)
    rig.add("A", prompt, seed=6, max_tokens=10)
    rig.step("small")
    held = rig.take_inbox("large") if order == "abort_first" else None
    rig.abort("A")
    rig.drain_until("small", lambda: "A" not in rig.small.engine.reqs, "abort on small")
    rig.drain_until("large", lambda: "A" in rig.large.states.aborted, "abort on large")
    if held is not None:
        msg = peer_msgs(held)
        assert only(msg).first is not None and only(msg).req.suffix == prompt
        rig.large._handle(msg)  # the PeerReq lands after the abort
        rig.send("large", msg)  # and once more, through the socket
    rig.settle()
    # Nothing to step: a resurrected request would show up here.
    assert not rig.large.engine.scheduler.has_work() and not rig.small.engine.scheduler.has_work()
    rig.assert_clean("small")
    rig.assert_clean("large")
    assert rig.finished("A") == [] and rig.tokens("A") == []

    rig.add("B", prompt, seed=7, max_tokens=4)
    finish_all(rig, ["B"])


# ---- finished by the peer -------------------------------------------------------------------------
def test_finished_by_peer_at_max_tokens(rig_factory):
    rig = rig_factory(1.0)
    (prompt,) = prompts_of([8], seed=16)
    n = len(prompt)
    rig.add("A", prompt, seed=8, max_tokens=3)
    for k in range(3):
        rig.step("small")
        rig.drain_until("large", lambda: rig.req("large", "A") is not None
                        and rig.req("large", "A").status is not ReqStatus.PENDING, "A on large")
        rig.step("large")
        if k < 2:
            rig.drain_until("small", lambda: rig.req("small", "A").status is ReqStatus.RUNNING, "hand-back")
    # The large model wrote the last token: it finished A and told the entry and the small model.
    assert "A" not in rig.large.engine.reqs
    assert rig.req("small", "A").status is ReqStatus.PENDING  # until it drains the finish notice
    rig.wait_entry(lambda: rig.finished("A"), "Finished")
    (fin,) = rig.finished("A")
    assert (fin.model, fin.reason, fin.stop_reason, fin.length) == ("large", "length", None, n + 3)
    # Tokens first: every token event of A came before the Finished. (The small model's hand-off counts
    # travel on another connection to the entry, so they may arrive after it: they carry no token.)
    idx_fin = rig.msgs.index(fin)
    with_a = [i for i, m in enumerate(rig.msgs) if isinstance(m, Tokens) and any(e.rid == "A" for e in m.items)]
    assert len(with_a) == 3 and all(i < idx_fin for i in with_a)
    assert [(m, pos) for m, pos, _ in rig.tokens("A")] == [("large", n + i) for i in range(3)]
    rig.drain_until("small", lambda: "A" not in rig.small.engine.reqs, "small frees its PENDING copy")
    rig.assert_clean("small")
    rig.assert_clean("large")


def test_finished_by_peer_at_eos(rig_factory):
    rig = rig_factory(1.0)
    (prompt,) = prompts_of([8], seed=17)
    n = len(prompt)
    # Probe: the large model's greedy tokens for this prompt (p = 1: it writes every token).
    rig.add("probe", prompt, seed=9, max_tokens=3)
    finish_all(rig, ["probe"])
    probe = [tok for _, _, tok in rig.tokens("probe")]
    assert len(probe) == 3
    # Make the large model's second token its EOS (or the first, if the first is the same token).
    eos = probe[1]
    k = probe.index(eos)
    rig.large.engine.eos_token_ids = {eos}
    rig.add("A", prompt, seed=9, max_tokens=10, ignore_eos=False)
    rig.pump(lambda: bool(rig.finished("A")), "A finished")
    (fin,) = rig.finished("A")
    assert (fin.model, fin.reason, fin.stop_reason, fin.length) == ("large", "stop", None, n + k + 1)
    assert [tok for _, _, tok in rig.tokens("A")] == probe[:k + 1]
    rig.drain_until("small", lambda: "A" not in rig.small.engine.reqs, "small frees its PENDING copy")
    rig.settle()
    rig.assert_clean("small")
    rig.assert_clean("large")


def test_finished_by_small_frees_the_large_copy(rig_factory):
    """The reverse: the large model holds a copy at its peer when the small model writes the last token."""
    p = 0.5
    rig = rig_factory(p)
    (prompt,) = prompts_of([7], seed=18)
    n = len(prompt)
    seed = find_seed([True, False, False, False], first=n, p=p)
    rig.add("A", prompt, seed, max_tokens=4)
    rig.step("small")
    rig.drain_until("large", lambda: rig.req("large", "A") is not None, "A's first visit")
    rig.step("large")
    lr = rig.req("large", "A")
    assert lr.at_peer  # PENDING, or RUNNING its look-ahead row (test_look_ahead.py)
    rig.drain_until("small", lambda: rig.req("small", "A").status is ReqStatus.RUNNING, "hand-back")
    for _ in range(3):
        rig.step("small")
    assert "A" not in rig.small.engine.reqs
    rig.wait_entry(lambda: rig.finished("A"), "Finished")
    (fin,) = rig.finished("A")
    assert (fin.model, fin.reason, fin.length) == ("small", "length", n + 4)
    # Token events from two models may reach the entry in either order: compare by position.
    assert [(pos, m) for m, pos, _ in sorted(rig.tokens("A"), key=lambda t: t[1])] == [
        (n, "large"), (n + 1, "small"), (n + 2, "small"), (n + 3, "small")]
    rig.drain_until("large", lambda: "A" not in rig.large.engine.reqs, "large frees its copy")
    # Its look-ahead row never ran (the large model had no other step): it was never PENDING there.
    assert rig.large.pending_seconds == 0.0
    rig.assert_clean("small")
    rig.assert_clean("large")


def test_seed_search_is_consistent_with_the_router():
    """The draws the tests pick seeds by are the router's: same function, same positions."""
    seed = find_seed([True, False, True], first=5, p=0.5)
    assert handoff_draws(seed, 5, 3, 0.5) == [True, False, True]


# ---- a hand-back that rewrites part of the copy -------------------------------------------------------
def test_handback_before_the_end_rolls_the_copy_back(rig_factory, paths):
    """A PeerReq whose loc lies before the end of a PENDING copy cuts the copy to loc and rolls its KV
    back: once above the cached prefix, once into it. Each resume computes only what follows the kept
    KV, and the next token is the small model's greedy choice for the rewritten sequence (stale KV past
    loc would change it)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(paths["small"], dtype=torch.float32).eval()

    def greedy(tokens: list[int]) -> int | None:
        with torch.no_grad():
            row = hf(input_ids=torch.tensor([tokens])).logits[0, -1]
        top2 = row.topk(2).values
        return None if (top2[0] - top2[1]).item() < 1e-5 else int(row.argmax())

    p = 0.5
    rig = rig_factory(p)
    (prompt,) = prompts_of([13], seed=19)
    n = len(prompt)
    # Positions n..n+5 stay on small, n+6 goes to the large model.
    seed = find_seed([False] * 6 + [True], first=n, p=p)
    small = rig.small.engine

    # Warm the small model's prefix cache with the prompt (P writes n, n+1 on small: no hand-off).
    rig.add("P", prompt, seed, max_tokens=2)
    finish_all(rig, ["P"])

    rig.add("A", prompt, seed, max_tokens=40)
    a = rig.req("small", "A")
    for _ in range(7):
        rig.step("small")
    assert a.status is ReqStatus.PENDING and len(a.tokens) == n + 6 and a.kv_len == n + 6
    cached = a.cached_len
    assert cached == (n - 1) // PAGE * PAGE and cached > 5, "A should hold a cached prefix"
    assert only(peer_msgs(rig.take_inbox("large"))).first is not None  # held off the large model

    def hand_back(loc: int, suffix: list[int]) -> tuple[list[int], int]:
        """Deliver a crafted hand-back; check the cut; return the expected tokens and the kept KV."""
        expected = a.tokens[:loc] + suffix
        rig.small._handle(Peer("large", [Handoff(PeerReq(rid="A", suffix=suffix, loc=loc))]))
        assert a.status is ReqStatus.RUNNING and a.tokens == expected
        assert a.kv_len <= loc, "KV past loc survived the cut"
        assert len(a.pages) == math.ceil(a.kv_len / PAGE)
        assert a.cached_len <= a.kv_len and len(a.pages) >= a.cached_len // PAGE
        small.check_integrity()
        return expected, a.kv_len

    def resume_and_check(expected: list[int], kept: int) -> None:
        """One step at position len(expected) (a kept token), then the hand-off at n+6."""
        ext, before = a.extended_tokens, small.stats.extended_tokens
        rig.step("small")
        assert a.extended_tokens - ext == len(expected) - kept, "recomputed more than the unseen suffix"
        assert small.stats.extended_tokens - before == len(expected) - kept
        assert a.status is ReqStatus.RUNNING and a.tokens[:-1] == expected and len(a.tokens) == n + 6
        ref = greedy(expected)
        if ref is not None:
            assert a.tokens[-1] == ref, "the token after the cut is not the small model's greedy choice"
        rig.step("small")  # position n+6: hand off again; the sampled token is dropped
        assert a.status is ReqStatus.PENDING and a.kv_len == n + 6 and len(a.tokens) == n + 6
        small.check_integrity()
        rig.take_inbox("large")

    # Cut 1: above the cached prefix, inside the output. The peer rewrote n+2.. with three new tokens.
    loc = n + 2
    assert loc > cached
    expected, kept = hand_back(loc, [300, 301, 302])
    assert kept == loc and a.cached_len == cached
    resume_and_check(expected, kept)

    # Cut 2: below the cached prefix. Only the whole cached pages under loc survive.
    loc = 5
    assert loc < cached
    suffix = [(t * 7 + 3) % 256 for t in a.tokens[loc:n + 5]]  # differs from the original tokens
    expected, kept = hand_back(loc, suffix)
    assert kept == loc // PAGE * PAGE and a.cached_len == kept
    resume_and_check(expected, kept)

    rig.abort("A")
    rig.drain_until("small", lambda: "A" not in small.reqs, "abort on small")
    rig.drain_until("large", lambda: "A" in rig.large.states.aborted, "abort on large")
    rig.settle()
    rig.assert_clean("small")
    rig.assert_clean("large")
