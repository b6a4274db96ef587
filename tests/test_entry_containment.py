"""The entry loop (server/async_entry.py) fails one request whose command raises in the entry thread,
and only it: the other requests of the batch finish whole and token-exact, and the group keeps
serving. The request that raises is one the edge would refuse (a seed past what the wire carries),
handed to the entry thread past the edge, as a defect in admission would: the entry thread's
containment is what is under test."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from engine_utils import prompts_of
from routing_utils import group_dict

from tokenrouter.runtime.group_config import GroupConfig
from tokenrouter.sampling_params import SamplingParams
from tokenrouter.server.async_entry import AsyncEntry, Done, TokenOut

N = 10
BAD = 3
PROMPTS = prompts_of([4, 5, 6, 7, 8, 9], seed=7)


@pytest.fixture(scope="module")
def entry(pair_paths):
    ae = AsyncEntry(GroupConfig.from_dict(group_dict(pair_paths, 0.5)))
    ae.start(timeout=120)
    yield ae
    ae.close()


async def run(ae: AsyncEntry, plans: list) -> list[tuple[list[TokenOut], Done]]:
    streams = [ae.submit(plan) for plan in plans]

    async def collect(stream) -> tuple[list[TokenOut], Done]:
        tokens = []
        while True:
            ev = await asyncio.wait_for(stream.events.get(), 60)
            if isinstance(ev, Done):
                return tokens, ev
            tokens.append(ev)

    return await asyncio.gather(*(collect(s) for s in streams))


def plans_of(ae: AsyncEntry) -> list:
    return [ae.admit(p, SamplingParams(max_tokens=N, temperature=0.0, seed=40 + i, ignore_eos=True))
            for i, p in enumerate(PROMPTS)]


def test_a_request_the_entry_thread_fails_on_fails_alone(entry):
    plans = plans_of(entry)
    good = [i for i in range(len(plans)) if i != BAD]
    alone = asyncio.run(run(entry, [plans[i] for i in good]))
    plans[BAD] = dataclasses.replace(plans[BAD], seed=2**64)  # msgpack cannot encode it: OverflowError
    results = asyncio.run(run(entry, plans))
    tokens, done = results[BAD]
    assert done.finish_reason == "error" and "could not be started" in done.error and not done.fatal, done
    assert tokens == []
    writers = set()
    for i, (want_tokens, _) in zip(good, alone):
        got_tokens, got = results[i]
        assert got.finish_reason == "length", (i, got)
        assert [(t.token, t.model) for t in got_tokens] == [(t.token, t.model) for t in want_tokens], i
        assert len(got_tokens) == N
        writers.update(t.model for t in got_tokens)
    assert writers == {"small", "large"}
    assert entry.healthy
    again = asyncio.run(run(entry, [plans[good[0]]]))
    assert [t.token for t in again[0][0]] == [t.token for t in alone[0][0]]
