"""The step board and core sharing (engine/step_board.py): a step of few rows runs on every core
while no other model's slot is set, on one otherwise; the slot is set for the step's duration and
before the peers are read; an engine given a CoreShare sizes each real step with it."""

from __future__ import annotations

import pytest
import torch
from engine_utils import prompts_of

from tokenrouter.engine.config import EngineConfig
from tokenrouter.engine.engine import Engine
from tokenrouter.engine.step_board import CoreShare, StepBoard, create_board
from tokenrouter.sampling_params import SamplingParams


@pytest.fixture
def boards():
    shm = create_board()
    mine, peer = StepBoard(shm.name, 0), StepBoard(shm.name, 1)
    yield mine, peer
    mine.close()
    peer.close()
    shm.close()
    shm.unlink()
    torch.set_num_threads(1)  # the suite's setting (tests/conftest.py)


def test_every_core_for_a_small_step_while_no_peer_steps(boards):
    mine, peer = boards
    share = CoreShare(2, 8, mine)
    with share.step(1) as threads:
        assert threads == 2 and torch.get_num_threads() == 2
        assert mine.flags[0] == 1.0 and peer.others_running() == 1  # the peer sees this step
    assert mine.flags[0] == 0.0 and peer.others_running() == 0
    with share.step(9) as threads:  # past max_rows: one thread
        assert threads == 1 and torch.get_num_threads() == 1
    with peer.running():
        with share.step(1) as threads:  # a peer is stepping: one thread
            assert threads == 1 and torch.get_num_threads() == 1
    assert share.threads_used == {2: 1, 1: 2}


def test_two_models_starting_at_once_cannot_both_take_every_core(boards):
    """The slot is set before the peers are read: of two steps that overlap, the second sees the first."""
    mine, peer = boards
    a, b = CoreShare(2, 8, mine), CoreShare(2, 8, peer)
    seen = []
    real = a.threads_for
    a.threads_for = lambda rows, live: seen.append(mine.flags[0]) or real(rows, live)  # type: ignore[method-assign]
    with a.step(1) as first:
        with b.step(1) as second:
            assert (first, second) == (2, 1)
    assert seen == [1.0]  # its own slot was already set when it read its peers' (a peer reading then sees it)


def test_without_a_board_only_the_rows_decide():
    share = CoreShare(3, 4)
    try:
        assert [share.threads_for(r) for r in (1, 4, 5)] == [3, 3, 1]
        with pytest.raises(ValueError, match="cores, max_rows and max_live >= 1"):
            CoreShare(0, 4)
    finally:
        torch.set_num_threads(1)


def test_an_engine_sizes_its_steps_with_it(model_paths, boards):
    """Prefill (many rows) on one thread, decode steps (few rows) on both; the tokens are the same as
    an engine's on one thread."""
    mine, _ = boards
    cfg = EngineConfig(model_path=str(model_paths["llama"]), kv_cache_tokens=1024, page_size=4, device="cpu")
    shared, plain = Engine(cfg, cores=CoreShare(2, 4, mine)), Engine(cfg)
    prompts = prompts_of([12, 3], seed=4)
    outs = []
    for eng in (shared, plain):
        reqs = [eng.add_request(p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)) for p in prompts]
        while eng.has_unfinished():
            eng.step()
        outs.append([r.output_ids for r in reqs])
    torch.set_num_threads(1)
    assert shared.cores is not None and shared.cores.threads_used == {1: 1, 2: 5}
    assert outs[0] == outs[1]


def test_a_model_alone_shares_at_any_load_and_beside_co_located_peers_at_one_request():
    """A model served alone shares cores at any load, and so does the one model spawned here beside a
    joined peer; a routed pair's co-located models share only while they hold one request (then the
    models take turns); a pinned or switched-off model does not."""
    from tokenrouter.runtime.group_config import GroupConfig

    def group(models: list[dict], **launch) -> GroupConfig:
        return GroupConfig.from_dict({"models": models, "launch": launch})

    one = group([{"name": "m", "path": "/x"}])
    assert one.core_sharing("m") == "alone"
    pair = group([{"name": "s", "path": "/x"}, {"name": "l", "path": "/y"}])
    assert [pair.core_sharing(n) for n in pair.names] == ["colocated", "colocated"]
    joined = GroupConfig.from_dict({"models": [{"name": "s", "path": "/x"},
                                               {"name": "l", "path": "/y", "start": "join"}],
                                    "transport": "tcp", "secret": "a secret of sixteen characters"})
    assert [joined.core_sharing(n) for n in joined.names] == ["alone", None]
    for changed in (group([{"name": "m", "path": "/x", "cores": [0]}]), group([{"name": "m", "path": "/x"}],
                                                                                share_cores=False)):
        assert changed.core_sharing("m") is None


def test_beside_co_located_peers_every_core_only_at_one_live_request(boards):
    mine, peer = boards
    share = CoreShare(2, 8, mine, max_live=1)
    peer.hold(2)  # the peer holds requests: it steps again soon
    with share.step(2, live=1) as threads:  # one request (a verification of one draft: two rows)
        assert threads == 2
    with share.step(20, live=1) as threads:  # taking turns, a larger step (a long catch-up) too
        assert threads == 2
    with share.step(1, live=2) as threads:  # a second request: the models no longer take turns
        assert threads == 1
    with share.step(20, live=2) as threads:
        assert threads == 1
    with peer.running():
        with share.step(20, live=1) as threads:  # a peer is stepping: one thread at any rows
            assert threads == 1
    with pytest.raises(ValueError, match="max_live >= 1"):
        CoreShare(2, 8, mine, max_live=0)


def test_beside_co_located_peers_that_hold_nothing_every_core_for_requests_written_alone(boards):
    """A peer holding no request (speculative's requests under load go to the verifier alone) has no
    step coming while this model hands none over: it takes every core for a small step however many
    requests it holds, if it writes them all alone."""
    mine, peer = boards
    share = CoreShare(2, 8, mine, max_live=1)
    peer.hold(0)
    with share.step(4, live=4) as threads:  # it may hand a request over: the peer may step soon
        assert threads == 1
    share.routes = False
    peer.hold(1)
    assert mine.others_hold() and not peer.others_hold()
    with share.step(4, live=4) as threads:
        assert threads == 1
    peer.hold(0)
    with share.step(4, live=4) as threads:
        assert threads == 2
    with share.step(9, live=4) as threads:  # past max_rows: one thread all the same
        assert threads == 1
    mine.hold(3)
    assert peer.others_hold() and share.threaded_steps == 1


def test_co_located_subservers_start_with_a_short_spin(monkeypatch):
    """The spin is set for the processes started inside and gone afterwards; a user's own wins."""
    import os
    import subprocess
    import sys

    from tokenrouter.engine.step_board import COLOCATED_SPINCOUNT, colocated_spin

    def child_sees() -> str:
        code = "import os; print(os.environ.get('GOMP_SPINCOUNT', '-'))"
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()

    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    with colocated_spin(True):
        assert child_sees() == COLOCATED_SPINCOUNT
    with colocated_spin(False):
        assert child_sees() == "-"
    assert "GOMP_SPINCOUNT" not in os.environ
    monkeypatch.setenv("GOMP_SPINCOUNT", "5")
    with colocated_spin(True):
        assert child_sees() == "5"
    assert os.environ["GOMP_SPINCOUNT"] == "5"
