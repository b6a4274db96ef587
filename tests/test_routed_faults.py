"""Process-level faults and bookkeeping of a routed group (RoutedLLM): a subserver killed mid-run, clean
shutdown, bad requests, stop strings at the entry, run statistics. Every wait is bounded."""

from __future__ import annotations

import os
import signal
import time

import pytest
from engine_utils import prompts_of
from routing_utils import build_pair, find_seed, group_dict

from tokenrouter.routed_llm import RoutedLLM
from tokenrouter.runtime.entry.entry import SubserverDied
from tokenrouter.runtime.entry.reassembly import Done, TokenOut
from tokenrouter.runtime.messages import Finished, TokenEvent, Tokens
from tokenrouter.sampling_params import SamplingParams

P = 0.3


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return build_pair(tmp_path_factory.mktemp("fault-models"))


@pytest.fixture(scope="module")
def llm(paths):
    with RoutedLLM(group_dict(paths, P)) as llm:
        yield llm


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def assert_no_live_requests(llm: RoutedLLM, timeout: float = 5.0) -> None:
    """Every model idle with no page outside the free list and the prefix cache, and the entry's records
    whole (nothing reserved). A peer's finish notice may still be on its way when generate returns, so
    ask again for a bounded time."""
    deadline = time.monotonic() + timeout
    while True:
        stats = llm.entry.stats()
        ok = all(s.live_requests == 0 and s.free_pages + s.cached_pages == s.total_pages for s in stats.values())
        if ok or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for name, s in stats.items():
        assert s.live_requests == 0, f"{name}: {s.live_requests} live requests"
        assert s.free_pages + s.cached_pages == s.total_pages, f"{name}: pages leaked ({s})"
    llm.entry.check_integrity()


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


# ---- a subserver dies ---------------------------------------------------------------------------------
@pytest.mark.parametrize("victim", ["small", "large"])
def test_killed_subserver_raises_and_leaves_no_process(paths, victim):
    llm = RoutedLLM(group_dict(paths, 0.5))
    try:
        procs = dict(llm.entry.procs)
        pid = procs[victim].pid
        entry = llm.entry
        real_poll = entry.poll
        seen = {"tokens": 0, "killed_at": None}

        def poll_then_kill(timeout: float = 0.1):
            events = real_poll(timeout)
            seen["tokens"] += sum(isinstance(ev, TokenOut) for ev in events)
            if seen["killed_at"] is None and seen["tokens"] >= 8:  # mid-run: tokens are flowing
                os.kill(pid, signal.SIGKILL)
                seen["killed_at"] = time.monotonic()
            return events

        entry.poll = poll_then_kill
        prompts = prompts_of([5 + i for i in range(8)], seed=21)
        with pytest.raises(SubserverDied, match=victim):
            llm.generate(prompt_token_ids=prompts, sampling_params=greedy(400), use_tqdm=False, timeout=60)
        raised_at = time.monotonic()
        assert seen["killed_at"] is not None, "generate ended before the kill"
        # A clear error within seconds of the kill, not at generate's 60 s timeout.
        assert raised_at - seen["killed_at"] < 5.0, f"raised {raised_at - seen['killed_at']:.1f} s after the kill"
        assert procs[victim].exitcode == -signal.SIGKILL
    finally:
        llm.close()
    for name, proc in procs.items():
        assert not proc.is_alive(), f"{name} still alive after close"
        assert gone(proc.pid), f"{name} (pid {proc.pid}) still exists after close"
    survivor = next(p for n, p in procs.items() if n != victim)
    assert survivor.exitcode == 0, "the surviving subserver should stop on Shutdown, not be killed"


def test_clean_shutdown_leaves_no_process(paths):
    """Also the p = 0 group: the small model writes everything, nothing is handed off."""
    with RoutedLLM(group_dict(paths, 0.0)) as llm:
        outs = llm.generate(prompt_token_ids=prompts_of([6, 9], seed=22), sampling_params=greedy(5),
                            use_tqdm=False, timeout=60)
        assert all(o.outputs[0].token_models == ["small"] * 5 for o in outs)
        run = llm.last_run
        assert run.handoffs == 0 and run.tokens_per_model == {"small": 10, "large": 0}
        assert run.mean_pending_seconds == 0.0
        procs = dict(llm.entry.procs)
        folder = llm.entry.pool.dir
        assert all(p.is_alive() for p in procs.values())
    for name, proc in procs.items():
        assert not proc.is_alive() and gone(proc.pid), f"{name} survived the context manager"
        assert proc.exitcode == 0, f"{name} exited with {proc.exitcode}: it was killed, not shut down"
    assert not os.path.exists(folder)
    llm.close()  # closing twice is harmless


# ---- bad requests -------------------------------------------------------------------------------
def _zero_max_tokens() -> SamplingParams:
    sp = greedy(4)
    sp.max_tokens = 0  # the constructor refuses 0; a caller can still mutate the field
    return sp


BAD = {
    "empty prompt": ([], greedy(4), r"prompt 0: prompt is empty"),
    "over context": ([1] * 512, greedy(4), r"prompt 0: .*512 tokens, but the context is 512 tokens"),
    "token too large": ([5, 320, 7], greedy(4), r"prompt 0: prompt token ids must be integers in \[0, 320\)"),
    "negative token": ([5, -1], greedy(4), r"prompt token ids must be integers in \[0, 320\)"),
    "max_tokens 0": ([5, 6, 7], _zero_max_tokens(), r"max_tokens must be at least 1, got 0"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_request_is_a_clear_error_and_the_group_keeps_serving(llm, case):
    prompt, params, message = BAD[case]
    assert llm.entry.context_len == 512 and llm.entry.vocab_size == 320
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False, timeout=60)
    (out,) = llm.generate(prompt_token_ids=[[3, 4, 5]], sampling_params=greedy(4), use_tqdm=False, timeout=60)
    assert out.finished and out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 4
    assert not llm.entry.reqs and not llm.entry.queue
    assert_no_live_requests(llm)


def test_the_entry_check_finds_a_leaked_reservation(llm):
    """Entry.check_integrity (run by every idle poll): a reservation no admitted request holds is an
    error naming it."""
    (out,) = llm.generate(prompt_token_ids=[[3, 4, 5]], sampling_params=greedy(3), use_tqdm=False, timeout=60)
    assert out.finished
    entry = llm.entry
    entry.check_integrity()
    entry.admission.reserved["small"] += 24  # what a request ending without release would leave
    try:
        with pytest.raises(AssertionError, match="KV reserved"):
            entry.check_integrity()
    finally:
        entry.admission.reserved["small"] -= 24
    entry.check_integrity()


def test_constructor_refuses_max_tokens_zero():
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        SamplingParams(max_tokens=0)


def test_bad_request_in_a_batch_aborts_the_good_ones(llm):
    good = prompts_of([7], seed=23)[0]
    with pytest.raises(ValueError, match=r"prompt 1: prompt is empty"):
        llm.generate(prompt_token_ids=[good, []], sampling_params=greedy(50), use_tqdm=False, timeout=60)
    assert not llm.entry.reqs and not llm.entry.queue
    assert all(v == 0 for v in llm.entry.reserved.values()), "the aborted request kept its KV reservation"
    assert_no_live_requests(llm)
    (out,) = llm.generate(prompt_token_ids=[good], sampling_params=greedy(6), use_tqdm=False, timeout=60)
    assert len(out.outputs[0].token_ids) == 6


def test_a_reused_rid_never_meets_its_earlier_admissions_messages(llm):
    entry = llm.entry
    prompt = prompts_of([6], seed=26)[0]
    first = entry.add(prompt, greedy(8), rid="again")
    entry.abort("again")
    second = entry.add(prompt, greedy(8), rid="again")
    assert first.wire != second.wire and entry.reqs == {"again": second}
    # What a subserver may still send of the first admission: found by neither wire id nor rid.
    events: list = []
    entry._on_tokens(Tokens("small", [TokenEvent(first.wire, len(prompt), 7)], {first.wire: 3}), events)
    entry._on_finished(Finished(first.wire, "small", "stop", None, len(prompt) + 1), events)
    assert events == [] and second.final is None and second.out.handoffs == 0 and not second.out.tokens
    deadline = time.monotonic() + 60
    while not any(isinstance(ev, Done) for ev in events):
        assert time.monotonic() < deadline, "the second admission did not finish"
        events += entry.poll(0.05)
    tokens = [ev for ev in events if isinstance(ev, TokenOut)]
    assert events[-1].finish_reason == "length" and len(tokens) == 8 and not entry.reqs
    assert_no_live_requests(llm)


# ---- stop strings at the entry ---------------------------------------------------------------------
def _pick_stop(text: str) -> int | None:
    """A position k >= 1 whose character is printable ASCII, not seen before, with clean text before it."""
    for k in range(1, len(text)):
        ch = text[k]
        if ch.isascii() and ch.isprintable() and not ch.isspace() and ch not in text[:k] \
                and "\ufffd" not in text[:k + 1]:
            return k
    return None


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cuts_and_finishes_everywhere(llm, include):
    prompts = prompts_of([4 + 3 * i for i in range(8)], seed=24)
    full = llm.generate(prompt_token_ids=prompts, sampling_params=greedy(40, seed=5), use_tqdm=False, timeout=60)
    picks = [(i, _pick_stop(o.outputs[0].text)) for i, o in enumerate(full)]
    i, k = next(((i, k) for i, k in picks if k is not None), (None, None))
    assert i is not None, "no output with a usable stop character (change the prompts' seed)"
    ref = full[i].outputs[0]
    stop = ref.text[k]

    (out,) = llm.generate(prompt_token_ids=[prompts[i]], sampling_params=greedy(40, seed=5, stop=[stop],
                          include_stop_str_in_output=include), use_tqdm=False, timeout=60)
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == ref.text[:k + 1 if include else k]
    assert 0 < len(c.token_ids) < len(ref.token_ids)
    assert c.token_ids == ref.token_ids[:len(c.token_ids)], "greedy routed output changed between runs"
    assert c.token_models == ref.token_models[:len(c.token_ids)]
    # The models may write a few tokens past the stop before its Abort reaches them: counted as written.
    assert sum(llm.last_run.tokens_per_model.values()) >= len(c.token_ids)
    # The stop string ended the request on every model: nothing live, no page held.
    assert not llm.entry.reqs
    assert_no_live_requests(llm, timeout=0.0)


# ---- statistics --------------------------------------------------------------------------------------
def test_run_statistics(llm):
    prompts = prompts_of([3 + 5 * i for i in range(6)], seed=25)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy(24), use_tqdm=False, timeout=60)
    run = llm.last_run
    assert run is not None
    written: dict[str, int] = {"small": 0, "large": 0}
    last_by_large = 0
    for o in outs:
        c = o.outputs[0]
        assert len(c.token_ids) == 24 and len(c.token_models) == 24
        for m in c.token_models:
            written[m] += 1
        last_by_large += c.token_models[-1] == "large"
        assert o.extra["tokens_per_model"] == {m: c.token_models.count(m) for m in set(c.token_models)}
    assert sum(run.tokens_per_model.values()) == sum(len(o.outputs[0].token_ids) for o in outs) == 6 * 24
    assert run.tokens_per_model == written
    assert written["large"] > 0 and run.handoffs > 0
    # Each large token is one hand-off there and one back, except when it ended the request.
    assert run.handoffs == 2 * written["large"] - last_by_large
    assert run.mean_pending_seconds >= 0.0 and run.wall_seconds > 0.0
    assert_no_live_requests(llm)


# ---- a request id used again (Entry.add accepts a caller's rid) -----------------------------------
def run_until_done(entry, reqs, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(r.done for r in reqs):
        assert time.monotonic() < deadline, "a request never finished"
        entry.poll(0.05)


def test_rid_reused_after_abort_completes(llm):
    """The aborted request's late messages (its first token goes to the large model, so a hand-off is
    in flight when the abort lands) never reach the new request of the same id: its output is the
    one its prompt gives alone."""
    prompt, other = prompts_of([6, 9], seed=27)
    seed = find_seed([True], first=len(prompt), p=P)  # the first token goes to the large model
    (want,) = llm.generate(prompt_token_ids=[other], sampling_params=greedy(8, seed=seed), use_tqdm=False, timeout=60)
    entry = llm.entry
    try:
        entry.add(prompt, greedy(8, seed=seed), rid="dup")
        entry.abort("dup")
        again = entry.add(other, greedy(8, seed=seed), rid="dup")
        run_until_done(entry, [again], timeout=5.0)
    finally:
        entry.abort("dup")
    assert again.finish_reason == "length"
    assert [(t.token, t.model) for t in again.out.tokens] == list(zip(want.outputs[0].token_ids,
                                                                      want.outputs[0].token_models))
    assert_no_live_requests(llm)


def test_rid_in_use_is_refused_and_the_first_request_is_untouched(llm):
    prompt = prompts_of([7], seed=28)[0]
    seed = find_seed([True], first=len(prompt), p=P)
    (want,) = llm.generate(prompt_token_ids=[prompt], sampling_params=greedy(12, seed=seed), use_tqdm=False,
                           timeout=60)
    entry = llm.entry
    try:
        first = entry.add(prompt, greedy(12, seed=seed), rid="twice")
        with pytest.raises(ValueError, match="'twice' is already in use"):
            entry.add(prompts_of([5], seed=29)[0], greedy(12, seed=seed + 1), rid="twice")
        run_until_done(entry, [first])
    finally:
        entry.abort("twice")
    assert first.finish_reason == "length"
    assert [(t.token, t.model) for t in first.out.tokens] == list(zip(want.outputs[0].token_ids,
                                                                      want.outputs[0].token_models))
    assert_no_live_requests(llm)


def test_garbage_on_the_sockets_is_dropped(llm):
    """Undecodable bytes on the entry's and a subserver's inbox are logged and dropped; serving goes on."""
    import zmq

    ctx = zmq.Context()
    try:
        for address in (llm.entry.entry_address, llm.entry.info["large"].address):
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(address)
            for junk in (b"", b"\x00\xff garbage", b"\x92\xa3add\x01"):  # empty, random, msgpack of the wrong shape
                sock.send(junk)
            sock.close()
    finally:
        ctx.term()
    prompt = prompts_of([5], seed=28)[0]
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=greedy(6, seed=3), use_tqdm=False, timeout=60)
    assert len(out[0].outputs[0].token_ids) == 6
    assert all(p.is_alive() for p in llm.entry.procs.values())
