"""The large model's own greedy answers to training problems: the text a student of it learns the
tasks from (sequence-level distillation) and the routers are labelled on.

Answers come from our engine (`LLM`: continuous batching, one prefill per prompt), greedy, capped at
the task's output length, exactly as `tokenrouter eval` asks them; an answer's ids end with the EOS
that stopped it (the engine keeps it), so the student learns where the large model stops. Each answer
is kept as token ids (no re-tokenisation: the ids the routers are labelled on are the ids the large
model wrote).
"""

from __future__ import annotations

import json
import multiprocessing
import os
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from tokenrouter.sampling_params import SamplingParams


@dataclass(frozen=True)
class Exchange:
    """One problem's prompt (chat-formatted ids) and the large model's greedy answer to it."""

    task: str
    prompt: list[int]
    answer: list[int]  # output ids, EOS included when the model stopped
    text: str  # the answer decoded

    @property
    def ids(self) -> list[int]:
        return self.prompt + self.answer


def answer(large: str | Path, task: str, prompts: Sequence[list[int]], max_tokens: int, progress: bool = False,
           max_running_requests: int = 64) -> list[Exchange]:
    """The large model at `large` answers every prompt greedily with at most `max_tokens` tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = generate(large, [list(p) for p in prompts], [params] * len(prompts), progress, max_running_requests)
    return [Exchange(task, list(p), list(o.outputs[0].token_ids), o.outputs[0].text) for p, o in zip(prompts, outs)]


# Prompts per worker below which the answers stay in this process: a worker's start-up (torch, the
# model) costs several seconds, which made CI's reduced prepare 15 s slower with 64.
MIN_SHARD = 256


def generate(model: str | Path, prompts: list[list[int]], params: list[SamplingParams], progress: bool,
             max_running_requests: int = 64, workers: int | None = None, shard: int | None = None) -> list[Any]:
    """`model` answers `prompts` on our engine with one torch thread per process, as a serving process
    runs: prepare trains with every core, and a decode step on two threads of a shared machine runs
    several times slower than on one (docs/DEPLOYMENT.md). With at least MIN_SHARD prompts per
    worker, `workers` processes (default: one per core) each load the model and answer equal shards
    (up to four per worker, at least MIN_SHARD prompts each, so the last to finish are short), and no
    core idles (the engine's decode products are single-threaded C); outputs come back in the
    prompts' order, and the bar counts answered prompts. `shard` sets the shard size instead."""
    import torch

    workers = workers or os.cpu_count() or 1
    if shard is None:
        per_worker = min(4, len(prompts) // (MIN_SHARD * workers))
        shard = -(-len(prompts) // (workers * per_worker)) if per_worker else len(prompts)
    workers = min(workers, -(-len(prompts) // max(shard, 1)))
    if workers <= 1:
        before = torch.get_num_threads()
        llm = _one_thread_llm(str(model), max_running_requests)
        try:
            return llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=progress)
        finally:
            llm.engine.shutdown()
            torch.set_num_threads(before)
    outs: list[Any] = [None] * len(prompts)
    starts = range(0, len(prompts), shard)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_load_worker,
                             initargs=(str(model), max_running_requests)) as pool, \
            tqdm(total=len(prompts), desc="generate", unit="req", disable=not progress) as bar:
        futures = {pool.submit(_answer_shard, prompts[i:i + shard], params[i:i + shard]): i for i in starts}
        for fut in as_completed(futures):
            i = futures[fut]
            part = fut.result()
            outs[i:i + len(part)] = part
            bar.update(len(part))
    return outs


_worker_llm: Any = None  # the model a generate worker process loaded (one per process)


def _one_thread_llm(model: str, max_running_requests: int) -> Any:
    import torch

    from tokenrouter.llm import LLM

    torch.set_num_threads(1)
    return LLM(model, max_running_requests=max_running_requests)


def _load_worker(model: str, max_running_requests: int) -> None:
    global _worker_llm
    _worker_llm = _one_thread_llm(model, max_running_requests)


def _answer_shard(prompts: list[list[int]], params: list[SamplingParams]) -> list[Any]:
    return _worker_llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)


def save(exchanges: Sequence[Exchange], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}")
    tmp.write_text("\n".join(json.dumps({"task": e.task, "prompt": e.prompt, "answer": e.answer, "text": e.text})
                             for e in exchanges) + "\n")
    tmp.rename(path)


def load(path: Path) -> list[Exchange]:
    out = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        d: dict[str, Any] = json.loads(line)
        try:
            out.append(Exchange(str(d["task"]), [int(x) for x in d["prompt"]], [int(x) for x in d["answer"]],
                                str(d["text"])))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}:{i}: not an exchange ({e})") from None
    return out
