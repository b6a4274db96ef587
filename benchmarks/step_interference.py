"""What the student running beside it costs SmolLM2's step: the large model's step at the compositions
the routed pair gives it, alone on the machine and with the student decoding in another process.

In the routed pair at concurrency 8 both models step at once, one per core, each streaming its
weights from the memory they share (SmolLM2 538 MB a step, the student 156 MB every ~10 ms). This
times SmolLM2's eager step (tokenrouter/engine/engine.py, as its subserver runs it) on fixed
compositions over 80-token contexts already in its cache:

- `dec B`: B requests decoding one token each (SmolLM2 alone serving B);
- `ext R x K`: R requests each feeding K new tokens (a catch-up: the student's tokens since the
  request's last visit) and sampling one, as the pair's SmolLM2 steps do (mean 2.8 requests, 16 rows).

Each round times every composition `--steps` times (median) with the machine otherwise quiet, then
again with the pair's student (--config: small first, large second) decoding `--student-batch`
requests in another process, sleeping between its steps so that it is busy `--student-busy` of the
time (the pair's student at 8: 0.63-0.65); each round pairs its two passes, so the machine's drift
between rounds cancels in the ratio. Prints each composition's median step, the ratio with the
student beside it, and the ratio's spread over the rounds.

`--neighbour` puts another process in the student's place, busy the same share of the time, to tell
what kind of work slows the step: `stream` sums a 256 MB tensor (memory traffic, no reuse),
`compute` multiplies 96 x 96 matrices that stay in the core's L2 cache (arithmetic, no memory traffic).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/step_interference.py --config PAIR.yaml --rounds 3
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/step_interference.py --config PAIR.yaml --rounds 5 --neighbour stream
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import count
from multiprocessing.synchronize import Event

import torch

from tokenrouter.engine.config import EngineConfig
from tokenrouter.engine.engine import Engine
from tokenrouter.engine.profiler import decode_seconds
from tokenrouter.runtime.group_config import GroupConfig
from tokenrouter.sampling_params import SamplingParams

CONTEXT = 80
COMPOSITIONS = (("dec", 8, 1), ("ext", 1, 1), ("ext", 3, 5), ("ext", 4, 4), ("ext", 3, 8))


def student_work(path: str, batch: int) -> Callable[[], object]:
    """One decode step of the student, `batch` requests at a time."""
    eng = Engine(EngineConfig(model_path=path, num_threads=1))
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    ids = count()

    def step() -> None:
        while len(eng.reqs) < batch:
            i = next(ids)
            eng.add_request([(31 * i + j) % 40000 + 100 for j in range(60)], params)
        eng.step()
    return step


def stream_work() -> Callable[[], object]:
    """One pass over 256 MB: memory traffic the cache cannot hold."""
    return torch.ones(64 << 20).sum


def compute_work() -> Callable[[], object]:
    """Matrix products on operands that stay in the core's L2 cache: arithmetic without memory traffic."""
    a, b = torch.randn(96, 96), torch.randn(96, 96)

    def products() -> None:
        for _ in range(400):
            torch.mm(a, b)
    return products


@contextmanager
def beside(kind: str, path: str, batch: int, busy: float) -> Iterator[None]:
    """`kind`'s neighbour (`neighbour_loop`) running in another process for the body's duration."""
    ctx = mp.get_context("spawn")
    started, stop = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=neighbour_loop, args=(kind, path, batch, busy, started, stop))
    proc.start()
    try:
        if not started.wait(300):
            raise SystemExit(f"the {kind} process did not run within 300 s")
        time.sleep(1.0)  # past its first runs
        yield
    finally:
        stop.set()
        proc.join(30)
        if proc.is_alive():
            proc.terminate()
            proc.join()


def neighbour_loop(kind: str, path: str, batch: int, busy: float, started: Event, stop: Event) -> None:
    """Run `kind`'s work over and over, idle between runs so the process is busy `busy` of the time
    (`path` and `batch`: the student's model and requests a step, read by `student` only)."""
    torch.set_num_threads(1)
    makers = {"student": lambda: student_work(path, batch), "stream": stream_work, "compute": compute_work}
    if kind not in makers:
        raise ValueError(f"neighbour kind {kind!r}: one of {', '.join(makers)}")
    work = makers[kind]()
    while not stop.is_set():
        t0 = time.perf_counter()
        work()
        started.set()
        time.sleep((time.perf_counter() - t0) * (1 / busy - 1))


class StepTimer:
    """SmolLM2's engine with 16 80-token prompts in its prefix cache; times one step of a composition."""

    def __init__(self, path: str) -> None:
        self.eng = Engine(EngineConfig(model_path=path, num_threads=1))
        self.base = [[(37 * i + 11 * j) % 40000 + 100 for j in range(CONTEXT)] for i in range(16)]
        self.fresh = count(1)
        self._prime()

    def _prime(self) -> None:
        """Put the base prompts in the prefix cache."""
        for p in self.base:
            self.eng.add_request(p, SamplingParams(max_tokens=1, ignore_eos=True))
        self._drain()

    def _drain(self) -> None:
        while self.eng.has_unfinished():
            self.eng.step()

    def _suffix(self, k: int) -> list[int]:
        n = next(self.fresh)
        return [(7919 * n + 13 * j) % 40000 + 100 for j in range(k)]

    def extend_ms(self, r: int, k: int, steps: int) -> float:
        """Each time: r requests hit the cached prefix and feed k new tokens in one step."""
        one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        times = []
        for _ in range(steps):
            for i in range(r):
                self.eng.add_request(self.base[i] + self._suffix(k), one)
            t0 = time.perf_counter()
            self.eng.step()
            times.append(time.perf_counter() - t0)
            self._drain()
        return 1000 * statistics.median(times)

    def decode_ms(self, b: int, steps: int) -> float:
        ms = 1000 * decode_seconds(self.eng, b, CONTEXT, steps)  # it empties the engine and its cache
        self._prime()
        return ms

    def row(self, steps: int) -> list[float]:
        return [self.decode_ms(r, steps) if kind == "dec" else self.extend_ms(r, k, steps)
                for kind, r, k in COMPOSITIONS]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=24, help="timed steps per composition and round")
    ap.add_argument("--config", required=True, help="the routed pair's YAML (small first, large second)")
    ap.add_argument("--student-batch", type=int, default=3)
    ap.add_argument("--student-busy", type=float, default=0.65)
    ap.add_argument("--neighbour", choices=("student", "stream", "compute"), default="student",
                    help="what runs beside SmolLM2's step, busy --student-busy of the time")
    args = ap.parse_args()
    if not 0 < args.student_busy <= 1:
        raise SystemExit(f"--student-busy must be in (0, 1], got {args.student_busy}")
    torch.set_num_threads(1)
    models = GroupConfig.from_yaml(args.config).models
    student, large = models[0].engine.model_path, models[-1].engine.model_path
    timer = StepTimer(large)
    timer.row(4)  # warm-up: kernels built, allocator settled
    names = [f"{kind} {r}" if kind == "dec" else f"ext {r} x {k}" for kind, r, k in COMPOSITIONS]
    quiet: list[list[float]] = []
    loaded: list[list[float]] = []
    for rnd in range(args.rounds):
        quiet.append(timer.row(args.steps))
        with beside(args.neighbour, student, args.student_batch, args.student_busy):
            loaded.append(timer.row(args.steps))
        print(f"round {rnd + 1}: " + ", ".join(f"{n} {q:.1f}/{b:.1f}" for n, q, b in zip(names, quiet[-1], loaded[-1])),
              flush=True)
    print(f"\n| composition | rows | quiet ms | {args.neighbour} beside ms | ratio (median) | range over rounds |")
    print("|---|---:|---:|---:|---:|---|")
    for j, (_, r, k) in enumerate(COMPOSITIONS):
        q = [row[j] for row in quiet]
        b = [row[j] for row in loaded]
        ratios = [y / x for x, y in zip(q, b)]
        print(f"| {names[j]} | {r * k} | {statistics.median(q):.1f} | {statistics.median(b):.1f} | "
              f"{statistics.median(ratios):.2f}x | {min(ratios):.2f}-{max(ratios):.2f} |")


if __name__ == "__main__":
    main()
