"""The running-steps board of a group's co-located subservers, and the cores a step runs on.

The board is a small array in shared memory (the entry creates it; each subserver it spawns attaches
by name), one slot per model of the group, set while that model runs a step, and beside each slot how
many requests that model holds (live or pending at a peer; its subserver writes it after every pass of
its loop). Two readers:
- the latency executor's interference (latency_model.py InterferenceClock): a model progresses
  more slowly while a peer's slot is set;
- core sharing (`CoreShare`): on a CPU host where models take turns, a step may use every core while
  no other model is stepping, and only one while another is.

Why core sharing: a model serving alone on a CPU host leaves its other cores idle at low load. The
rule: every core for a step of at most `max_rows` rows (the quantized kernel's, where more threads
pay: models/quantized_linear.py) while no other model's slot is set; one thread otherwise (large
steps come with load, when the server's other processes have work). A model alone on its host takes
it at any load. Beside co-located peers (runtime/group_config.py `GroupConfig.core_sharing`) a model
takes it only while it holds at most one live request (then the group serves one request, which is
on one model at a time, so the models take turns) or while it writes every request it holds alone
and no peer holds any (speculative's `disable_by_batch_size` sends the requests that start under
load to the verifier alone). Otherwise sharing measured slower (the default pair at 8: 166 tok/s against
219-233 with one thread each), because after each step the second thread's OpenMP spin-wait keeps a
core the peer's step needs. Co-located subservers are started with the spin cut to
`COLOCATED_SPINCOUNT` rounds (libgomp's GOMP_SPINCOUNT, read when the process loads it; the default
is 300,000): at one request with `speculative`, sharing made 58.4 tok/s with the default spin and
66.7-67.5 with 10,000 (1,000: 49.9, slower than not sharing, 50.1); a passive wait made every step
slower (SmolLM2 alone 39 tok/s at 1 request against 70).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from multiprocessing import shared_memory

import numpy as np
import torch

SLOTS = 64
COLOCATED_SPINCOUNT = "10000"  # GOMP_SPINCOUNT for co-located subservers (module docstring)


@contextlib.contextmanager
def colocated_spin(colocated: bool) -> Iterator[None]:
    """Processes started inside (a spawned process reads its parent's environment as it starts) get
    GOMP_SPINCOUNT = COLOCATED_SPINCOUNT when `colocated` and the user set none; the environment is
    as it was afterwards."""
    if not colocated or "GOMP_SPINCOUNT" in os.environ:
        yield
        return
    os.environ["GOMP_SPINCOUNT"] = COLOCATED_SPINCOUNT
    try:
        yield
    finally:
        del os.environ["GOMP_SPINCOUNT"]


def create_board() -> shared_memory.SharedMemory:
    """A group's board (the entry creates it, owns it and unlinks it), every slot clear."""
    shm = shared_memory.SharedMemory(create=True, size=2 * SLOTS * 8)
    np.ndarray((2 * SLOTS,), dtype=np.float64, buffer=shm.buf)[:] = 0.0
    return shm


class StepBoard:
    """One model's view of the board `name`: its own slot `me` and its peers'. `flags`: the stepping
    slots; `held`: each model's request count."""

    def __init__(self, name: str, me: int) -> None:
        if not 0 <= me < SLOTS:
            raise ValueError(f"a board has {SLOTS} slots; slot {me} is outside")
        self.me = me
        self._shm = shared_memory.SharedMemory(name=name)
        self.flags: np.ndarray | None = np.ndarray((SLOTS,), dtype=np.float64, buffer=self._shm.buf)
        self.held: np.ndarray | None = np.ndarray((SLOTS,), dtype=np.float64, buffer=self._shm.buf, offset=SLOTS * 8)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """This model's slot set for the duration."""
        flags = self.flags
        if flags is None:
            yield
            return
        flags[self.me] = 1.0
        try:
            yield
        finally:
            flags[self.me] = 0.0

    def _others(self, values: np.ndarray | None) -> int:
        """How many other models' entries of `values` (flags or held) are set."""
        if values is None:
            return 0
        return int(np.count_nonzero(values)) - int(values[self.me] > 0)

    def others_running(self) -> int:
        """How many other models are in a step now."""
        return self._others(self.flags)

    def hold(self, requests: int) -> None:
        """Publish how many requests this model holds."""
        if self.held is not None:
            self.held[self.me] = requests

    def others_hold(self) -> bool:
        """Whether another model holds any request."""
        return self._others(self.held) > 0

    def close(self) -> None:
        self.flags = self.held = None
        self._shm.close()


class CoreShare:
    """Sizes each step's torch threads: all of `cores` for a step of at most `max_rows` rows while no
    other model on `board` runs a step (and, with `max_live`, while this model holds at most that
    many live requests, or holds none it may hand to a peer while no other model holds any), one
    otherwise; marks this model's slot while its step runs. Without a board (one model alone on the
    host) only the rows decide.

    While a co-located model holds at most `max_live` live requests the models take turns, so its
    larger steps (a prompt, a catch-up of more than `max_rows` tokens) take every core too: a routed
    pair at one request spent a sixth of its time in those on one thread.

    `routes`: whether this model holds a request it may hand to a peer (one its algorithm routes, not
    one it writes alone); its subserver sets it after every pass of its loop. Why it counts: a routed
    pair at two requests has stretches where the large model holds none (both requests fresh on the
    small one), and sharing there cost the pair 4% (100.6-109.1 against 105.3-110.5 tok/s, four
    rounds each), the second thread's spin-wait holding the core the large model's next step needs."""

    def __init__(self, cores: int, max_rows: int, board: StepBoard | None = None, max_live: int | None = None) -> None:
        if cores < 1 or max_rows < 1 or (max_live is not None and max_live < 1):
            raise ValueError(f"core sharing needs cores, max_rows and max_live >= 1, got {cores}, {max_rows} "
                             f"and {max_live}")
        self.cores, self.max_rows, self.board, self.max_live = cores, max_rows, board, max_live
        self.routes = True
        self.threads_used: dict[int, int] = {}  # threads -> steps run on that many (for the stats)

    @staticmethod
    def host_cores() -> int:
        """The cores this process may run on."""
        return len(os.sched_getaffinity(0))

    def threads_for(self, rows: int, live: int = 1) -> int:
        turns = self.max_live is not None and live <= self.max_live
        crowded = self.max_live is not None and live > self.max_live and (
            self.routes or self.board is None or self.board.others_hold())
        if (rows > self.max_rows and not turns) or crowded or (self.board is not None and self.board.others_running()):
            return 1
        return self.cores

    @contextlib.contextmanager
    def step(self, rows: int, live: int = 1) -> Iterator[int]:
        """Run a step of `rows` rows, of a model holding `live` live requests, on the threads the rule
        gives (yielded). The slot is set before the peers are read, so two models starting at once
        cannot both take every core."""
        with self.board.running() if self.board is not None else contextlib.nullcontext():
            threads = self.threads_for(rows, live)
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
            self.threads_used[threads] = self.threads_used.get(threads, 0) + 1
            yield threads

    @property
    def threaded_steps(self) -> int:
        return sum(n for threads, n in self.threads_used.items() if threads > 1)
